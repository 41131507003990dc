"""A mamba-ssm checkpoint directory: config.json and the weights in whichever form it
holds them, read into named tensors."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from .config import ModelConfig, load_config
from .errors import ExportError
from .safetensors_io import INDEX_NAME, SINGLE_NAME, read_safetensors, read_safetensors_index
from .tensor import Tensor
from .torch_load import read_with_torch, torch_available
from .torch_zip import read_torch_zip

BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
PICKLE_READERS = ("auto", "torch", "restricted")


@dataclass
class Checkpoint:
    config: ModelConfig
    config_json: dict[str, Any]  # config.json as read, written out unchanged
    tensors: dict[str, Tensor]
    weights_path: Path            # the file the weights were read from (or their index)
    reader: str                   # how they were read, for the log


def _read_pickle(path: Path, pickle_reader: str) -> tuple[dict[str, Tensor], str]:
    use_torch = pickle_reader == "torch" or (pickle_reader == "auto" and torch_available())
    if use_torch:
        if not torch_available():
            raise ExportError(f"{path}: --pickle-reader torch, but torch is not installed")
        return read_with_torch(path), "torch.load(weights_only=True)"
    return read_torch_zip(path), "restricted reader (no torch)"


def _read_bin_index(index_path: Path, pickle_reader: str) -> tuple[dict[str, Tensor], str]:
    source = str(index_path)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{source}: cannot read: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ExportError(f"{source}: weight_map must be an object of tensor names to shard file names")
    out: dict[str, Tensor] = {}
    reader = ""
    for shard in sorted(set(weight_map.values())):
        if not shard or len(PurePath(shard).parts) != 1 or shard in (".", ".."):
            raise ExportError(f'{source}: shard "{shard}" is not a file name')
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise ExportError(f"{source}: shard {shard} does not exist")
        tensors, reader = _read_pickle(shard_path, pickle_reader)
        for name, t in tensors.items():
            if name in out:
                raise ExportError(f"{t.source}: tensor {name} is also stored in {out[name].source}")
            if weight_map.get(name) != shard:
                raise ExportError(f"{t.source}: tensor {name} is not listed in {source} under this shard")
            out[name] = t
    for name, shard in weight_map.items():
        if name not in out:
            raise ExportError(f"{source}: tensor {name} is listed in shard {shard} but not found there")
    return out, reader


def read_checkpoint(src: Path, pickle_reader: str = "auto") -> Checkpoint:
    """Reads SRC's config.json and weights: model.safetensors.index.json (sharded
    safetensors), model.safetensors, pytorch_model.bin or pytorch_model.bin.index.json,
    the first found in that order."""
    if pickle_reader not in PICKLE_READERS:
        raise ExportError(f"pickle reader must be one of {', '.join(PICKLE_READERS)}, got {pickle_reader!r}")
    if not src.is_dir():
        raise ExportError(f"{src}: not a directory (expected a checkpoint directory with config.json)")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{src}: no config.json (save_pretrained writes one beside the weights)")
    config, config_json = load_config(config_path)

    if (src / INDEX_NAME).is_file():
        path, tensors, reader = src / INDEX_NAME, read_safetensors_index(src / INDEX_NAME), "safetensors shards"
    elif (src / SINGLE_NAME).is_file():
        path, tensors, reader = src / SINGLE_NAME, read_safetensors(src / SINGLE_NAME), "safetensors"
    elif (src / BIN_NAME).is_file():
        path = src / BIN_NAME
        tensors, reader = _read_pickle(path, pickle_reader)
    elif (src / BIN_INDEX_NAME).is_file():
        path = src / BIN_INDEX_NAME
        tensors, reader = _read_bin_index(path, pickle_reader)
    else:
        raise ExportError(f"{src}: no weights: expected {INDEX_NAME}, {SINGLE_NAME}, {BIN_NAME} or {BIN_INDEX_NAME}")
    return Checkpoint(config, config_json, tensors, path, reader)
