"""The export itself: read and check everything, then write the model directory."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

from .check import check_structure, check_values
from .checkpoint import read_checkpoint
from .errors import ExportError
from .layout import LM_HEAD
from .safetensors_io import write_model_tensors
from .tensor import DTYPES, Tensor, contiguous, f32_to_bf16_bits, to_f32

OUTPUT_DTYPES = {"fp32": "F32", "bf16": "BF16"}


def convert(t: Tensor, out_dtype: str) -> Tensor:
    """`t` in the output dtype ("F32" or "BF16"); exact for F32 output, rounded to nearest
    even for BF16 (a BF16 source is kept bit for bit)."""
    if t.dtype.name == out_dtype:
        return t
    if out_dtype == "F32":
        data = to_f32(t)
    elif t.dtype.name == "BF16":
        data = t.data
    else:
        data = f32_to_bf16_bits(to_f32(t))
    return Tensor(t.name, DTYPES[out_dtype], contiguous(data), t.source)


def _prepare_out_dir(out: Path) -> bool:
    """Creates OUT (True) or accepts it empty (False); refuses to mix with other files."""
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"{out}: exists and is not a directory")
        if any(out.iterdir()):
            raise ExportError(f"{out}: not empty; export into a new or empty directory")
        return False
    try:
        out.mkdir(parents=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot create: {e.strerror or e}") from None
    return True


def export(src: Path, out: Path, dtype: str = "fp32", shard_size: int | None = None,
           pickle_reader: str = "auto", log: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Exports the checkpoint directory `src` to the m3serve model directory `out`.
    Nothing is written unless every check passes. Returns the files written."""
    if dtype not in OUTPUT_DTYPES:
        raise ExportError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if shard_size is not None and shard_size <= 0:
        raise ExportError(f"--shard-size must be positive, got {shard_size}")
    out_dtype = OUTPUT_DTYPES[dtype]

    ckpt = read_checkpoint(src, pickle_reader)
    log(f"read {ckpt.weights_path} ({ckpt.reader}): {len(ckpt.tensors)} tensors")
    names = check_structure(ckpt.config, ckpt.tensors, str(ckpt.weights_path))
    for name in names:
        check_values(ckpt.tensors[name], out_dtype)
    tied = ckpt.config.tie_embeddings and LM_HEAD in ckpt.tensors

    created = _prepare_out_dir(out)
    itemsize = DTYPES[out_dtype].itemsize
    sizes = [(n, math.prod(ckpt.tensors[n].shape) * itemsize) for n in names]
    written: list[Path] = []
    try:
        written = write_model_tensors(out, sizes, lambda n: convert(ckpt.tensors[n], out_dtype), shard_size)
        config_path = out / "config.json"
        config_path.write_text(json.dumps(ckpt.config_json, indent=2) + "\n", encoding="utf-8")
        written.append(config_path)
    except BaseException:
        # No half-written model directory: a later load would fail less clearly.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in out.iterdir():
                p.unlink(missing_ok=True)
        raise
    total = sum(nbytes for _, nbytes in sizes)
    shards = sum(1 for p in written if p.suffix == ".safetensors")
    log(f"wrote {out}: {len(names)} tensors in {out_dtype}, {total} bytes, "
        + ("model.safetensors" if shards == 1 else f"{shards} shards with model.safetensors.index.json")
        + (f"; {LM_HEAD} is tied to backbone.embedding.weight and stored once" if tied else ""))
    return written
