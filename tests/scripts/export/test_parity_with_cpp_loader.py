"""The exporter checks a checkpoint by the C++ loader's rules: for each fault below, given
as an m3serve model directory, m3check (the C++ loader) and the exporter refuse it with the
same message. A rule changed on one side only fails here."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import GOLDEN_TINY, export_error, m3check_error

ssm = "backbone.layers.0.mixer."


def drop(name):
    return lambda t, c: t.pop(name)


def reshape(name, shape):
    return lambda t, c: t.__setitem__(name, np.zeros(shape, np.float32))


def config(edit):
    return lambda t, c: edit(c)


def ssm_cfg(**kv):
    return config(lambda c: c["ssm_cfg"].update(kv))


CASES = {
    "missing": drop(ssm + "mimo_z"),
    "shape": reshape(ssm + "in_proj.weight", (801, 128)),
    "unpadded_vocab": reshape("backbone.embedding.weight", (510, 128)),
    "dtype": lambda t, c: t.__setitem__(ssm + "D", t[ssm + "D"].astype(np.int32)),
    "f64": lambda t, c: t.__setitem__(ssm + "D", t[ssm + "D"].astype(np.float64)),
    "surplus": lambda t, c: t.__setitem__("backbone.layers.7.norm.weight", np.ones(128, np.float32)),
    "head_differs": lambda t, c: t.__setitem__("lm_head.weight", t["lm_head.weight"] + 1),
    "head_dtype": lambda t, c: t.__setitem__("lm_head.weight", t["lm_head.weight"].astype(np.float16)),
    "head_shape": reshape("lm_head.weight", (512, 64)),
    "untied_head_missing": lambda t, c: (t.pop("lm_head.weight"), c.update(tie_embeddings=False)),
    "outproj_norm_missing": ssm_cfg(is_outproj_norm=True),
    "mlp_missing": config(lambda c: c.update(d_intermediate=100)),
    "mlp_rounding": lambda t, c: (c.update(d_intermediate=100),
                                  t.update({f"backbone.layers.{i}.{n}": np.ones(s, np.float32)
                                            for i in range(2)
                                            for n, s in (("norm2.weight", (128,)), ("mlp.fc1.weight", (200, 128)),
                                                         ("mlp.fc2.weight", (128, 100)))})),
    "rope_fraction_one": ssm_cfg(rope_fraction=1.0),
    "pad_multiple": config(lambda c: c.update(pad_vocab_size_multiple=7)),
    "no_ssm_cfg": config(lambda c: c.pop("ssm_cfg")),
    "siso": ssm_cfg(is_mimo=False),
    "mamba2": ssm_cfg(layer="Mamba2"),
    "ngroups": ssm_cfg(ngroups=2),
    "odd_d_state": ssm_cfg(d_state=33),
    "rope_fraction": ssm_cfg(rope_fraction=0.3),
    "a_floor": ssm_cfg(A_floor=-1),
    "headdim": ssm_cfg(headdim=48),
    "layernorm": config(lambda c: c.update(rms_norm=False)),
    "residual": config(lambda c: c.update(residual_in_fp32=False)),
    "attention": config(lambda c: c.update(attn_layer_idx=[1])),
    "layers": config(lambda c: c.update(n_layer=2000)),
    "d_model_string": config(lambda c: c.update(d_model="128")),
    "d_model_float": config(lambda c: c.update(d_model=128.5)),
    "d_model_huge": config(lambda c: c.update(d_model=2**40)),
    "bool_as_int": config(lambda c: c.update(tie_embeddings=1)),
    "vocab_missing": config(lambda c: c.pop("vocab_size")),
    "state_too_large": lambda t, c: c.update(n_layer=1000, d_model=4096),
}


def model_dir(tmp_path: Path, edit) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    tensors = dict(load_file(GOLDEN_TINY / "model.safetensors"))
    cfg = json.loads((GOLDEN_TINY / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_the_cpp_loaders_message(tmp_path, case):
    d = model_dir(tmp_path, CASES[case])
    cpp = m3check_error(d)
    ours = export_error(d, tmp_path / "out")
    assert ours == cpp
    assert not (tmp_path / "out").exists()


def test_a_model_both_accept(tmp_path):
    # Integral floats are integers to both (some exporters write every number as a float).
    d = model_dir(tmp_path, config(lambda c: c.update(d_model=128.0)))
    from conftest import run_export, run_m3check
    assert run_export(d, tmp_path / "out").code == 0
    assert run_m3check(d).code == 0
