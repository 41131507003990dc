"""Safetensors files: reading (one file, or shards listed by model.safetensors.index.json)
and writing (one file, or shards of a bounded size with the index).

Reading parses the header here and maps the data with numpy: the safetensors package's
numpy binding cannot return BF16 tensors (numpy has no bfloat16). The checks are the C++
reader's (model/safetensors.cc), so a file refused there is refused here with the same
reason. Writing goes through the safetensors package.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path, PurePath
from typing import Any, Callable

import numpy as np
import safetensors

from .errors import ExportError
from .tensor import DTYPES, Tensor, contiguous, shape_str

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the Hugging Face reader's limit, and the C++ reader's

# safetensors.TensorSpec spells dtypes as numpy/torch do.
_SPEC_DTYPE = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
               "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file, mapped read-only."""
    source = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ExportError(f"{source}: file is {size} bytes, too short for the 8-byte header length (truncated?)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise ExportError(f"{source}: header length {header_len} is implausibly large (limit "
                                  f"{MAX_HEADER_BYTES}); not a safetensors file?")
            if header_len > size - 8:
                raise ExportError(f"{source}: header length {header_len} runs past the end of the file "
                                  f"({size} bytes; truncated?)")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise ExportError(f"{source}: cannot read: {e.strerror or e}") from None
    if b"\0" in header_bytes:
        raise ExportError(f"{source}: header is not valid JSON: NUL byte at header offset {header_bytes.index(0)}")
    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise ExportError(f"{source}: tensor {e.args[0]}: appears twice in the header") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{source}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ExportError(f"{source}: header is not a JSON object")

    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, Tensor] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ExportError(f"{source}: __metadata__ must be an object of strings")
            continue

        def fail(what: str) -> ExportError:
            return ExportError(f"{source}: tensor {name}: {what}")

        if not isinstance(entry, dict):
            raise fail("header entry is not an object")
        dtype_name = entry.get("dtype")
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise fail(f"unknown dtype {json.dumps(dtype_name)}")
        dtype = DTYPES[dtype_name]
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise fail(f"shape must be a list of non-negative integers, got {json.dumps(shape)}")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(v) for v in offsets)):
            raise fail(f"data_offsets must be [begin, end] with non-negative integers, got {json.dumps(offsets)}")
        begin, end = offsets
        if begin > end:
            raise fail(f"data_offsets {offsets} has begin > end")
        if end > data_size:
            raise fail(f"data_offsets {offsets} run past the data section ({data_size} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != end - begin:
            raise fail(f"shape {shape_str(shape)} of {dtype.name} needs {numel * dtype.itemsize} bytes, "
                       f"data_offsets {offsets} hold {end - begin}")
        if numel == 0:
            data = np.empty(shape, dtype=dtype.numpy)
        else:
            data = np.memmap(path, dtype=dtype.numpy, mode="r", offset=data_start + begin, shape=tuple(shape))
            ranges.append((begin, end, name))
        tensors[name] = Tensor(name, dtype, data, source)

    ranges.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(ranges, ranges[1:]):
        if begin < prev_end:
            raise ExportError(f"{source}: tensor {name}: data range overlaps tensor {prev}")
    return tensors


def read_safetensors_index(index_path: Path) -> dict[str, Tensor]:
    """Every tensor of the shards an index lists, checked as the C++ loader checks them:
    each tensor in one shard, the shard the index names, and nothing unlisted."""
    source = str(index_path)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ExportError(f"{source}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(index, dict):
        raise ExportError(f"{source}: not a JSON object")
    weight_map = index.get("weight_map")
    if weight_map is None:
        raise ExportError(f"{source}: missing weight_map")
    if not isinstance(weight_map, dict):
        raise ExportError(f"{source}: weight_map is not an object")

    shard_tensors: dict[str, dict[str, Tensor]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ExportError(f"{source}: weight_map entry for tensor {name} is not a string")
        rel = PurePath(shard)
        if not shard or rel.is_absolute() or len(rel.parts) != 1 or shard in (".", ".."):
            raise ExportError(f'{source}: tensor {name} names shard "{shard}", which is not a file name')
        if shard not in shard_tensors:
            shard_path = index_path.parent / shard
            if not shard_path.is_file():
                raise ExportError(f"{source}: shard {shard} (listed for tensor {name}) does not exist")
            shard_tensors[shard] = read_safetensors(shard_path)

    out: dict[str, Tensor] = {}
    for shard, tensors in shard_tensors.items():
        for name, t in tensors.items():
            if name in out:
                raise ExportError(f"{t.source}: tensor {name} is also stored in {out[name].source}")
            if name not in weight_map:
                raise ExportError(f"{t.source}: tensor {name} is not listed in {source}")
            if weight_map[name] != shard:
                raise ExportError(f"{t.source}: tensor {name} is listed in {source} under shard {weight_map[name]}")
            out[name] = t
    for name, shard in weight_map.items():
        if name not in out:
            raise ExportError(f"{source}: tensor {name} is listed in shard {shard} but not found there")
    return out


def _write_file(path: Path, tensors: list[Tensor]) -> None:
    arrays = [contiguous(t.data) for t in tensors]  # kept alive while the library reads them
    specs = {
        t.name: safetensors.TensorSpec(dtype=_SPEC_DTYPE[t.dtype.name], shape=list(t.shape),
                                       data_ptr=a.ctypes.data, data_len=a.nbytes)
        for t, a in zip(tensors, arrays)
    }
    try:
        safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})
    except Exception as e:  # the library raises its own error type for I/O faults
        raise ExportError(f"{path}: cannot write: {e}") from None
    # The library creates files readable by their owner only; a model directory is read by
    # whoever serves it, so the file gets the mode the umask gives any new file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def plan_shards(sizes: list[tuple[str, int]], shard_size: int | None) -> list[list[str]]:
    """Names grouped into shards in the given order, each shard at most `shard_size` bytes
    unless one tensor alone is larger (it then fills a shard by itself). None: one file."""
    if shard_size is None:
        return [[name for name, _ in sizes]]
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, nbytes in sizes:
        if current and filled + nbytes > shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += nbytes
    if current:
        shards.append(current)
    return shards


def write_model_tensors(out_dir: Path, sizes: list[tuple[str, int]], produce: Callable[[str], Tensor],
                        shard_size: int | None) -> list[Path]:
    """Writes the tensors named in `sizes` (name, bytes as written), in that order, to
    model.safetensors, or to shards model-0000k-of-0000n.safetensors with
    model.safetensors.index.json when they do not fit in one. `produce` makes each tensor
    just before its file is written, so at most one shard's conversions are held at a time.
    Returns the files written."""
    shards = plan_shards(sizes, shard_size)
    if len(shards) == 1:
        path = out_dir / SINGLE_NAME
        _write_file(path, [produce(n) for n in shards[0]])
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _write_file(out_dir / file_name, [produce(n) for n in names])
        written.append(out_dir / file_name)
        weight_map.update({n: file_name for n in names})
    index = {"metadata": {"total_size": sum(nbytes for _, nbytes in sizes)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    written.append(out_dir / INDEX_NAME)
    return written
