"""Checks a checkpoint's tensors against its config, by the C++ loader's rules
(model/weights.cc: names, shapes, float dtypes, the tied head, nothing surplus), plus what
the loader leaves to the engines: every value finite, and representable in the output dtype.
Every error names the file and the tensor."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .errors import ExportError
from .layout import EMBEDDING, LM_HEAD, expected_tensors, head_shape
from .tensor import WEIGHT_DTYPES, Tensor, non_finite, shape_str, to_f32

# float32 magnitudes from this bit pattern up round to infinity in BF16 (ties to even:
# the largest BF16, 0x7F7F, is odd).
_BF16_OVERFLOW_BITS = np.uint32(0x7F7F8000)


def _check_one(t: Tensor | None, name: str, shape: tuple[int, ...], missing_where: str) -> Tensor:
    if t is None:
        raise ExportError(f"{missing_where}: tensor {name} is missing (config needs shape {shape_str(shape)})")
    if t.shape != shape:
        raise ExportError(f"{t.source}: tensor {name} has shape {shape_str(t.shape)}, config needs {shape_str(shape)}")
    if t.dtype.name not in WEIGHT_DTYPES:
        raise ExportError(f"{t.source}: tensor {name} has dtype {t.dtype.name}, expected F32, BF16 or F16")
    return t


def check_structure(c: ModelConfig, tensors: dict[str, Tensor], where: str) -> list[str]:
    """Names, shapes and dtypes. Returns the names to write, in checkpoint order: the
    tensors the config needs, and lm_head.weight only when the head is not tied (a tied
    head is the embedding, stored once). `where` names the checkpoint for a missing tensor."""
    expected = expected_tensors(c)
    for name, shape in expected:
        _check_one(tensors.get(name), name, shape, where)

    head = tensors.get(LM_HEAD)
    if not c.tie_embeddings or head is not None:
        _check_one(head, LM_HEAD, head_shape(c), where)
    if c.tie_embeddings and head is not None:
        # A tied checkpoint stores one parameter under two names; different values mean
        # the file is not what its config says.
        emb = tensors[EMBEDDING]
        if head.dtype is not emb.dtype:
            raise ExportError(f"{head.source}: tensor {LM_HEAD} is {head.dtype.name} but {EMBEDDING} is "
                              f"{emb.dtype.name}, and the config has tie_embeddings = true (one parameter "
                              "stored twice)")
        if not np.array_equal(head.data, emb.data):
            raise ExportError(f"{head.source}: tensor {LM_HEAD} differs from {EMBEDDING}, but the config has "
                              "tie_embeddings = true")

    expected_names = {name for name, _ in expected}
    surplus = sorted(n for n in tensors if n != LM_HEAD and n not in expected_names)
    if surplus:
        listed = ", ".join(surplus[:8])
        if len(surplus) > 8:
            listed += f", ... ({len(surplus)} in all)"
        raise ExportError(f"{tensors[surplus[0]].source}: tensors the config does not use: {listed} "
                          "(check n_layer, d_intermediate, is_outproj_norm)")

    names = [name for name, _ in expected]
    if not c.tie_embeddings:
        names.append(LM_HEAD)
    return names


def check_values(t: Tensor, out_dtype: str) -> None:
    """Every value finite, and finite once rounded to `out_dtype` ("F32" or "BF16")."""
    n_nan, n_inf, first = non_finite(t)
    if first is not None:
        raise ExportError(f"{t.source}: tensor {t.name} holds {n_nan} NaN and {n_inf} infinite values "
                          f"(the first at index {shape_str(first)})")
    if out_dtype == "BF16" and t.dtype.name == "F32":
        magnitude = to_f32(t).view(np.uint32) & np.uint32(0x7FFFFFFF)
        over = magnitude >= _BF16_OVERFLOW_BITS
        if over.any():
            first = tuple(int(i) for i in np.argwhere(over)[0])
            raise ExportError(f"{t.source}: tensor {t.name} holds {int(over.sum())} values beyond BF16's range "
                              f"(the first at index {shape_str(first)}); export it with --dtype fp32")
