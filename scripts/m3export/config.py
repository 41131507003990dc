"""config.json in mamba-ssm's MambaConfig layout, parsed and validated by the rules of
the C++ loader (model/config.cc), so that a config the exporter accepts loads in m3serve.
Keep the two in step: each rule here names its counterpart's message."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ExportError

INT_MAX = 2**31 - 1
INT_MIN = -(2**31)
MAX_LAYERS = 1024
MAX_STATE_BYTES_PER_SEQUENCE = 16.0 * 2**30
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class SsmConfig:
    layer: str = "Mamba3"
    is_mimo: bool = False
    mimo_rank: int = 4
    d_state: int = 128
    headdim: int = 64
    expand: int = 2
    ngroups: int = 1
    rope_fraction: float = 0.5
    is_outproj_norm: bool = False
    A_floor: float = 1e-4


@dataclass
class ModelConfig:
    d_model: int = 0
    n_layer: int = 0
    vocab_size: int = 0
    d_intermediate: int = 0
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    attn_layer_idx: list[int] = field(default_factory=list)
    ssm: SsmConfig = field(default_factory=SsmConfig)

    # Derived sizes, as ModelConfig in model/config.h names them.
    def d_inner(self) -> int:
        return self.ssm.expand * self.d_model

    def n_heads(self) -> int:
        return self.d_inner() // self.ssm.headdim

    def rope_split(self) -> int:
        split = int(self.ssm.d_state * self.ssm.rope_fraction)
        return split - split % 2

    def n_angles(self) -> int:
        return self.rope_split() // 2

    def padded_vocab(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    def mlp_width(self) -> int:
        return (self.d_intermediate + 127) // 128 * 128

    def has_mlp(self) -> bool:
        return self.d_intermediate > 0

    def bc_width(self) -> int:
        return self.ssm.mimo_rank * self.ssm.ngroups * self.ssm.d_state

    def in_proj_rows(self) -> int:
        return 2 * self.d_inner() + 2 * self.bc_width() + 3 * self.n_heads() + self.n_angles()

    def state_floats_per_layer(self) -> int:
        H, P, N, R = self.n_heads(), self.ssm.headdim, self.ssm.d_state, self.ssm.mimo_rank
        return H * self.n_angles() + H * P * N + R * H * N + H * P


def _brief(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 64 else text[:61] + "..."


def _type_name(v: Any) -> str:
    # nlohmann::json's type names, so messages read as the C++ loader's.
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


class _Reader:
    """Reads typed keys of one JSON object; errors name the source and the key's path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> ExportError:
        return ExportError(f"{self.source}: {what}")

    def int(self, obj: dict, key: str, path: str, default: int, required: bool = False) -> int:
        if key not in obj:
            if required:
                raise self.fail(f"missing required key {path}")
            return default
        v = obj[key]
        if isinstance(v, int) and not isinstance(v, bool):
            if v > INT_MAX:
                raise self.fail(f"{path} = {_brief(v)} is too large")
            if v < INT_MIN:
                raise self.fail(f"{path} = {_brief(v)} is out of range")
            return v
        # Integral floats (2.0) are accepted: some exporters write every number as a float.
        if isinstance(v, float) and math.isfinite(v) and v == math.floor(v) and abs(v) <= INT_MAX:
            return int(v)
        raise self.fail(f"{path} must be an integer, got {_type_name(v)} {_brief(v)}")

    def bool(self, obj: dict, key: str, path: str, default: bool) -> bool:
        if key not in obj:
            return default
        v = obj[key]
        if not isinstance(v, bool):
            raise self.fail(f"{path} must be true or false, got {_type_name(v)} {_brief(v)}")
        return v

    def float(self, obj: dict, key: str, path: str, default: float) -> float:
        if key not in obj:
            return default
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(f"{path} must be a number, got {_type_name(v)} {_brief(v)}")
        return float(v)

    def str(self, obj: dict, key: str, path: str) -> str:
        if key not in obj:
            raise self.fail(f"missing required key {path}")
        v = obj[key]
        if not isinstance(v, str):
            raise self.fail(f"{path} must be a string, got {_type_name(v)} {_brief(v)}")
        return v


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json_text(text: str, source: str) -> Any:
    """JSON as the C++ loader reads it (no NaN or Infinity literals)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as e:
        raise ExportError(f"{source}: not valid JSON: {e}") from None


def parse_config(root: Any, source: str) -> ModelConfig:
    """The config from a parsed config.json, validated; errors name `source`."""
    r = _Reader(source)
    if not isinstance(root, dict):
        raise r.fail(f"config must be a JSON object, got {_type_name(root)}")
    c = ModelConfig()
    c.d_model = r.int(root, "d_model", "d_model", 0, required=True)
    c.n_layer = r.int(root, "n_layer", "n_layer", 0, required=True)
    c.vocab_size = r.int(root, "vocab_size", "vocab_size", 0, required=True)
    c.d_intermediate = r.int(root, "d_intermediate", "d_intermediate", c.d_intermediate)
    c.pad_vocab_size_multiple = r.int(root, "pad_vocab_size_multiple", "pad_vocab_size_multiple",
                                      c.pad_vocab_size_multiple)
    c.tie_embeddings = r.bool(root, "tie_embeddings", "tie_embeddings", c.tie_embeddings)
    c.rms_norm = r.bool(root, "rms_norm", "rms_norm", c.rms_norm)
    c.residual_in_fp32 = r.bool(root, "residual_in_fp32", "residual_in_fp32", c.residual_in_fp32)
    c.fused_add_norm = r.bool(root, "fused_add_norm", "fused_add_norm", c.fused_add_norm)

    attn = root.get("attn_layer_idx")
    if attn is not None:
        if not isinstance(attn, list):
            raise r.fail(f"attn_layer_idx must be a list, got {_type_name(attn)}")
        for v in attn:
            if not isinstance(v, int) or isinstance(v, bool):
                raise r.fail(f"attn_layer_idx must hold integers, got {_brief(v)}")
            c.attn_layer_idx.append(v)

    s = root.get("ssm_cfg")
    if s is None:
        raise r.fail('missing ssm_cfg (mamba-ssm would build Mamba1 layers); only ssm_cfg.layer = '
                     '"Mamba3" is supported')
    if not isinstance(s, dict):
        raise r.fail(f"ssm_cfg must be an object, got {_type_name(s)}")
    m = c.ssm
    m.layer = r.str(s, "layer", "ssm_cfg.layer")
    m.is_mimo = r.bool(s, "is_mimo", "ssm_cfg.is_mimo", m.is_mimo)
    m.mimo_rank = r.int(s, "mimo_rank", "ssm_cfg.mimo_rank", m.mimo_rank)
    m.d_state = r.int(s, "d_state", "ssm_cfg.d_state", m.d_state)
    m.headdim = r.int(s, "headdim", "ssm_cfg.headdim", m.headdim)
    m.expand = r.int(s, "expand", "ssm_cfg.expand", m.expand)
    m.ngroups = r.int(s, "ngroups", "ssm_cfg.ngroups", m.ngroups)
    m.rope_fraction = r.float(s, "rope_fraction", "ssm_cfg.rope_fraction", m.rope_fraction)
    m.is_outproj_norm = r.bool(s, "is_outproj_norm", "ssm_cfg.is_outproj_norm", m.is_outproj_norm)
    m.A_floor = r.float(s, "A_floor", "ssm_cfg.A_floor", m.A_floor)

    validate_config(c, source)
    return c


def _g(v: float) -> str:
    # std::ostream's default formatting of a double (6 significant digits).
    return f"{v:g}"


def validate_config(c: ModelConfig, source: str) -> None:
    """Refuses what the engines cannot run, as ModelConfig::validate does."""
    r = _Reader(source)

    def positive(name: str, v: int) -> None:
        if v <= 0:
            raise r.fail(f"{name} must be positive, got {v}")

    positive("d_model", c.d_model)
    positive("n_layer", c.n_layer)
    if c.n_layer > MAX_LAYERS:
        raise r.fail(f"n_layer = {c.n_layer} is over the supported {MAX_LAYERS}")
    positive("vocab_size", c.vocab_size)
    positive("pad_vocab_size_multiple", c.pad_vocab_size_multiple)
    if c.d_intermediate < 0:
        raise r.fail(f"d_intermediate must be >= 0 (0 = no MLP), got {c.d_intermediate}")
    if c.attn_layer_idx:
        raise r.fail("attention layers are not supported: attn_layer_idx = " +
                     "[" + ", ".join(str(i) for i in c.attn_layer_idx) + "]")
    m = c.ssm
    if m.layer != "Mamba3":
        raise r.fail(f'ssm_cfg.layer = "{m.layer}" is not supported; only "Mamba3" is')
    if not m.is_mimo:
        raise r.fail("ssm_cfg.is_mimo = false (SISO Mamba3) is not supported; only MIMO models are")
    if m.mimo_rank < 1:
        raise r.fail(f"ssm_cfg.mimo_rank must be >= 1, got {m.mimo_rank}")
    positive("ssm_cfg.d_state", m.d_state)
    positive("ssm_cfg.headdim", m.headdim)
    positive("ssm_cfg.expand", m.expand)
    if m.ngroups != 1:
        raise r.fail(f"ssm_cfg.ngroups = {m.ngroups} is not supported; only 1 is")
    if m.d_state % 2 != 0:
        raise r.fail(f"ssm_cfg.d_state = {m.d_state} must be even (rotary pairs (i, i + N/2))")
    if m.rope_fraction not in (0.5, 1.0):
        raise r.fail(f"ssm_cfg.rope_fraction = {_g(m.rope_fraction)} is not supported; use 0.5 or 1.0")
    if not math.isfinite(m.A_floor) or m.A_floor < 0:
        raise r.fail(f"ssm_cfg.A_floor = {_g(m.A_floor)} must be a finite number >= 0")
    if not c.rms_norm:
        raise r.fail("rms_norm = false (LayerNorm blocks) is not supported")
    if not c.residual_in_fp32:
        raise r.fail("residual_in_fp32 = false is not supported; the engines keep the residual stream in fp32")

    d_inner = m.expand * c.d_model
    bc = m.mimo_rank * m.ngroups * m.d_state
    padded = (c.vocab_size + c.pad_vocab_size_multiple - 1) // c.pad_vocab_size_multiple * \
        c.pad_vocab_size_multiple
    rows = 2 * d_inner + 2 * bc + 3 * (d_inner // m.headdim) + m.d_state
    mlp = (c.d_intermediate + 127) // 128 * 128
    if d_inner > INT_MAX // 4 or rows > INT_MAX or padded > INT_MAX or mlp > INT_MAX // 2:
        raise r.fail("model sizes are too large (a derived dimension exceeds 2^31)")
    if d_inner % m.headdim != 0:
        raise r.fail(f"d_inner = expand * d_model = {d_inner} is not divisible by ssm_cfg.headdim = {m.headdim}")
    state_bytes = 4.0 * c.state_floats_per_layer() * c.n_layer
    if state_bytes > MAX_STATE_BYTES_PER_SEQUENCE:
        raise r.fail(f"the recurrent state of one sequence would need {_g(state_bytes / 2**30)} GiB "
                     "(n_layer x (heads x headdim x d_state + ...) floats), over the supported 16 GiB")


def load_config(path: Path) -> tuple[ModelConfig, dict]:
    """The validated config and the parsed JSON object it came from (written out as is)."""
    source = str(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ExportError(f"{source}: cannot read: {e.strerror}") from None
    if size > MAX_CONFIG_BYTES:
        raise ExportError(f"{source}: {size} bytes, over the {MAX_CONFIG_BYTES} a model config may have")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"{source}: cannot read: {e}") from None
    root = parse_json_text(text, source)
    return parse_config(root, source), root
