"""pytorch_model.bin through torch itself, where torch is installed: torch.load with
weights_only=True, which refuses everything but tensors and plain containers, so nothing
from the file runs either. It also reads torch.save's legacy (non-zip) format."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ExportError
from .tensor import DTYPES, Tensor, contiguous


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _reason(e: Exception) -> str:
    """torch's refusal without its advice to retry with weights_only=False (which would run
    the file's code) or to read its documentation."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    kept = [line for line in lines if "weights_only" not in line and not line.startswith("Check the documentation")]
    return f"{type(e).__name__}: {' '.join(kept or lines)}"


def read_with_torch(path: Path) -> dict[str, Tensor]:
    import torch  # noqa: PLC0415 (optional dependency)

    dtypes: dict[Any, str] = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }
    source = str(path)
    try:
        root = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types; each is a refusal of the file
        raise ExportError(f"{source}: torch.load(weights_only=True) refused it: {_reason(e)}") from None
    if not isinstance(root, dict):
        raise ExportError(f"{source}: holds a {type(root).__name__}, expected a state dict "
                          "(a dict of tensor names to tensors, as save_pretrained writes)")
    out: dict[str, Tensor] = {}
    for name, value in root.items():
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"{source}: state dict entry {name} is a {type(value).__name__}, not a tensor")
        if value.dtype not in dtypes:
            raise ExportError(f"{source}: tensor {name} has torch dtype {value.dtype}, which m3serve cannot store")
        dtype = DTYPES[dtypes[value.dtype]]
        t = value.detach().contiguous()
        array = t.view(torch.int16).numpy().view(np.uint16) if dtype.name == "BF16" else t.numpy()
        out[name] = Tensor(name, dtype, contiguous(array.astype(dtype.numpy, copy=False)), source)
    return out
