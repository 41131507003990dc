"""Faulty checkpoints are refused with one line that names the file and the tensor, and
nothing is written. The save_pretrained cases are torch.save files
(tests/data/torch_checkpoints/errors, made by make_fixtures.py); the others are
safetensors checkpoints made here from the golden tiny model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import GOLDEN_TINY, TORCH_FIXTURES, export_error, run_export

ERRORS = TORCH_FIXTURES / "errors"


@pytest.mark.parametrize("case, message", [
    ("missing_tensor", "pytorch_model.bin: tensor backbone.layers.0.mixer.D is missing (config needs shape [4])"),
    ("wrong_shape", "pytorch_model.bin: tensor backbone.layers.0.mixer.dt_bias has shape [5], config needs [4]"),
    ("nan", "pytorch_model.bin: tensor backbone.layers.0.mixer.in_proj.weight holds 1 NaN and 0 infinite values "
            "(the first at index [3, 7])"),
])
def test_save_pretrained_faults_are_named(tmp_path, case, message):
    out = tmp_path / "model"
    assert export_error(ERRORS / case, out) == f"{ERRORS / case}/{message}"
    assert not out.exists()


def golden_checkpoint(tmp_path: Path, edit=None, config_edit=None) -> Path:
    """golden_tiny as a safetensors checkpoint, its tensors passed through `edit(dict)`."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    tensors = dict(load_file(GOLDEN_TINY / "model.safetensors"))
    if edit:
        edit(tensors)
    save_file(tensors, src / "model.safetensors")
    config = json.loads((GOLDEN_TINY / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_infinity_is_named(tmp_path):
    def edit(t):
        t["backbone.layers.1.mixer.out_proj.weight"] = t["backbone.layers.1.mixer.out_proj.weight"].copy()
        t["backbone.layers.1.mixer.out_proj.weight"][5, 2] = -np.inf
        t["backbone.layers.1.mixer.out_proj.weight"][6, 0] = np.inf
    src = golden_checkpoint(tmp_path, edit)
    assert export_error(src, tmp_path / "out") == (
        f"{src}/model.safetensors: tensor backbone.layers.1.mixer.out_proj.weight holds 0 NaN and 2 infinite "
        "values (the first at index [5, 2])")


def test_values_beyond_bf16_are_refused_for_bf16_output(tmp_path):
    def edit(t):
        t["backbone.norm_f.weight"] = t["backbone.norm_f.weight"].copy()
        t["backbone.norm_f.weight"][9] = 3.4e38
    src = golden_checkpoint(tmp_path, edit)
    assert export_error(src, tmp_path / "out", "--dtype", "bf16") == (
        f"{src}/model.safetensors: tensor backbone.norm_f.weight holds 1 values beyond BF16's range "
        "(the first at index [9]); export it with --dtype fp32")
    # In fp32 the same value is fine.
    assert not (tmp_path / "out").exists()


def test_integer_dtype_is_named(tmp_path):
    def edit(t):
        t["backbone.layers.0.mixer.D"] = np.arange(8, dtype=np.int64)
    src = golden_checkpoint(tmp_path, edit)
    assert export_error(src, tmp_path / "out") == (
        f"{src}/model.safetensors: tensor backbone.layers.0.mixer.D has dtype I64, expected F32, BF16 or F16")


def test_surplus_tensors_are_listed(tmp_path):
    def edit(t):
        t["backbone.layers.2.norm.weight"] = np.ones(128, np.float32)
        t["backbone.layers.0.mixer.norm.weight"] = np.ones(256, np.float32)
    src = golden_checkpoint(tmp_path, edit)
    assert export_error(src, tmp_path / "out") == (
        f"{src}/model.safetensors: tensors the config does not use: backbone.layers.0.mixer.norm.weight, "
        "backbone.layers.2.norm.weight (check n_layer, d_intermediate, is_outproj_norm)")


def test_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    def edit(t):
        t["lm_head.weight"] = t["lm_head.weight"] * 2
    src = golden_checkpoint(tmp_path, edit)
    assert export_error(src, tmp_path / "out") == (
        f"{src}/model.safetensors: tensor lm_head.weight differs from backbone.embedding.weight, but the "
        "config has tie_embeddings = true")


def test_untied_head_is_required_and_written(tmp_path):
    src = golden_checkpoint(tmp_path, lambda t: t.pop("lm_head.weight"),
                            lambda c: c.update(tie_embeddings=False))
    assert export_error(src, tmp_path / "out") == (
        f"{src}/model.safetensors: tensor lm_head.weight is missing (config needs shape [512, 128])")

    untied = golden_checkpoint(tmp_path / "untied", config_edit=lambda c: c.update(tie_embeddings=False))
    out = tmp_path / "untied_out"
    r = run_export(untied, out)
    assert r.code == 0, r.err
    written = load_file(out / "model.safetensors")
    assert np.array_equal(written["lm_head.weight"], load_file(GOLDEN_TINY / "model.safetensors")["lm_head.weight"])


def test_config_faults_are_named(tmp_path):
    src = golden_checkpoint(tmp_path, config_edit=lambda c: c["ssm_cfg"].update(rope_fraction=0.25))
    assert export_error(src, tmp_path / "out") == (
        f"{src}/config.json: ssm_cfg.rope_fraction = 0.25 is not supported; use 0.5 or 1.0")


def test_missing_weights_and_config_are_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    assert export_error(src, tmp_path / "out") == (
        f"{src}: no config.json (save_pretrained writes one beside the weights)")
    shutil.copy(GOLDEN_TINY / "config.json", src / "config.json")
    assert export_error(src, tmp_path / "out") == (
        f"{src}: no weights: expected model.safetensors.index.json, model.safetensors, pytorch_model.bin "
        "or pytorch_model.bin.index.json")
