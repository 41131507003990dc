"""The tensors a config needs, with mamba-ssm's names and the shapes the C++ loader
checks (model/weights.cc, expected_tensors): keep the two in step."""
from __future__ import annotations

from .config import ModelConfig

EMBEDDING = "backbone.embedding.weight"
LM_HEAD = "lm_head.weight"


def layer_tensor_name(layer: int, suffix: str) -> str:
    return f"backbone.layers.{layer}.{suffix}"


def expected_tensors(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the config needs, in checkpoint order. lm_head.weight
    is not listed: it is required only when the head is not tied (see head_shape)."""
    d, di, H = c.d_model, c.d_inner(), c.n_heads()
    R, N, P, V, F = c.ssm.mimo_rank, c.ssm.d_state, c.ssm.headdim, c.padded_vocab(), c.mlp_width()
    out: list[tuple[str, tuple[int, ...]]] = [(EMBEDDING, (V, d))]
    for i in range(c.n_layer):
        def add(suffix: str, *shape: int) -> None:
            out.append((layer_tensor_name(i, suffix), tuple(shape)))

        add("norm.weight", d)
        add("mixer.in_proj.weight", c.in_proj_rows(), d)
        add("mixer.dt_bias", H)
        add("mixer.D", H)
        add("mixer.B_bias", H, R, N)
        add("mixer.C_bias", H, R, N)
        add("mixer.B_norm.weight", N)
        add("mixer.C_norm.weight", N)
        add("mixer.mimo_x", H, R, P)
        add("mixer.mimo_z", H, R, P)
        add("mixer.mimo_o", H, R, P)
        if c.ssm.is_outproj_norm:
            add("mixer.norm.weight", di)
        add("mixer.out_proj.weight", d, di)
        if c.has_mlp():
            add("norm2.weight", d)
            add("mlp.fc1.weight", 2 * F, d)
            add("mlp.fc2.weight", d, F)
    out.append(("backbone.norm_f.weight", (d,)))
    return out


def head_shape(c: ModelConfig) -> tuple[int, int]:
    return (c.padded_vocab(), c.d_model)
