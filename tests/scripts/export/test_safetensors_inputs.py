"""Checkpoints in safetensors, single or sharded with model.safetensors.index.json, export
to the same model as the save_pretrained checkpoint."""
from __future__ import annotations

import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from conftest import GOLDEN_TINY, SAVE_PRETRAINED_TINY, export_error, run_export, run_m3check


def test_single_safetensors_input(tmp_path):
    out = tmp_path / "model"
    r = run_export(GOLDEN_TINY, out)
    assert r.code == 0, r.err
    check = run_m3check(out)
    assert check.code == 0, check.err
    assert check.max_rel_err <= 1e-4 and check.greedy_match


def sharded_golden(tmp_path, shards: int = 3):
    """golden_tiny split into `shards` files with an index, as Hugging Face writes them."""
    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copy(GOLDEN_TINY / "config.json", src / "config.json")
    tensors = load_file(GOLDEN_TINY / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, src / file_name, metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src, weight_map


def test_sharded_safetensors_input_gives_the_same_model(tmp_path):
    src, _ = sharded_golden(tmp_path)
    out = tmp_path / "model"
    r = run_export(src, out)
    assert r.code == 0, r.err
    assert "model.safetensors.index.json (safetensors shards)" in r.out
    check = run_m3check(out)
    assert check.code == 0, check.err
    assert check.max_rel_err <= 1e-4 and check.greedy_match

    from_bin = tmp_path / "from_bin"
    assert run_export(SAVE_PRETRAINED_TINY, from_bin).code == 0
    a, b = load_file(out / "model.safetensors"), load_file(from_bin / "model.safetensors")
    assert set(a) == set(b)
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_sharded_input_faults_are_named(tmp_path):
    src, weight_map = sharded_golden(tmp_path)
    index = src / "model.safetensors.index.json"
    name = "backbone.layers.0.mixer.D"
    wrong = dict(weight_map)
    wrong[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    index.write_text(json.dumps({"weight_map": wrong}))
    assert export_error(src, tmp_path / "out") == (
        f"{src / weight_map[name]}: tensor {name} is listed in {index} under shard {wrong[name]}")

    del wrong[name]
    index.write_text(json.dumps({"weight_map": wrong}))
    assert export_error(src, tmp_path / "out") == f"{src / weight_map[name]}: tensor {name} is not listed in {index}"

    wrong[name] = "../elsewhere.safetensors"
    index.write_text(json.dumps({"weight_map": wrong}))
    assert export_error(src, tmp_path / "out") == (
        f'{index}: tensor {name} names shard "../elsewhere.safetensors", which is not a file name')


def test_truncated_safetensors_is_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(GOLDEN_TINY / "config.json", src / "config.json")
    data = (GOLDEN_TINY / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-1000])
    message = export_error(src, tmp_path / "out")
    assert message.startswith(f"{src}/model.safetensors: tensor ")
    assert "run past the data section" in message
