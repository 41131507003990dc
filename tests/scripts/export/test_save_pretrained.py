"""A checkpoint as mamba-ssm's save_pretrained writes it (torch.save of the state dict, the
tied head sharing the embedding's storage, config.json), exported without torch: the result
decodes the golden trajectory within the fp32 tolerance, sharded or not, and within the
bf16 tolerance when written in bf16."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
from safetensors.numpy import load_file

from conftest import (GOLDEN_TINY, SAVE_PRETRAINED_TINY, export_error, run_export, run_m3check,
                      safetensors_header)


def test_exported_without_torch_passes_m3check_at_fp32_tolerance(tmp_path):
    out = tmp_path / "model"
    r = run_export(SAVE_PRETRAINED_TINY, out, "--pickle-reader", "restricted")
    assert r.code == 0, r.err
    assert "restricted reader (no torch)" in r.out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    check = run_m3check(out)
    assert check.code == 0, check.err
    assert check.max_rel_err <= 1e-4
    assert check.greedy_match


def test_tied_head_is_stored_once_and_weights_are_bit_exact(tmp_path):
    out = tmp_path / "model"
    assert run_export(SAVE_PRETRAINED_TINY, out).code == 0
    header = safetensors_header(out / "model.safetensors")
    assert "lm_head.weight" not in header
    assert "tied to backbone.embedding.weight and stored once" in run_export(SAVE_PRETRAINED_TINY, tmp_path / "again").out

    written = load_file(out / "model.safetensors")
    golden = load_file(GOLDEN_TINY / "model.safetensors")
    assert set(written) == set(golden) - {"lm_head.weight"}
    for name, value in written.items():
        assert value.dtype == np.float32, name
        assert np.array_equal(value, golden[name]), name


def test_config_is_written_as_the_checkpoint_has_it(tmp_path):
    out = tmp_path / "model"
    assert run_export(SAVE_PRETRAINED_TINY, out).code == 0
    assert json.loads((out / "config.json").read_text()) == json.loads((SAVE_PRETRAINED_TINY / "config.json").read_text())


def test_default_reader_without_torch_is_the_restricted_one(tmp_path):
    if importlib.util.find_spec("torch") is not None:
        import pytest
        pytest.skip("torch is installed here; the default then reads through torch.load")
    r = run_export(SAVE_PRETRAINED_TINY, tmp_path / "model")
    assert r.code == 0, r.err
    assert "restricted reader (no torch)" in r.out


def test_sharded_export_loads_and_passes_m3check(tmp_path):
    out = tmp_path / "model"
    r = run_export(SAVE_PRETRAINED_TINY, out, "--shard-size", "300KB")
    assert r.code == 0, r.err
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert not (out / "model.safetensors").exists()

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert sorted(set(weight_map.values())) == shards
    total = 0
    for shard in shards:
        header = safetensors_header(out / shard)
        names = [n for n in header if n != "__metadata__"]
        assert sorted(names) == sorted(n for n, s in weight_map.items() if s == shard)
        nbytes = sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in names)
        # Only a tensor larger than the limit fills a shard beyond it, alone.
        assert nbytes <= 300_000 or len(names) == 1, (shard, nbytes)
        total += nbytes
    assert index["metadata"]["total_size"] == total

    check = run_m3check(out)
    assert check.code == 0, check.err
    assert check.max_rel_err <= 1e-4 and check.greedy_match


def test_bf16_export_passes_m3check_at_bf16_tolerance(tmp_path):
    out = tmp_path / "model"
    r = run_export(SAVE_PRETRAINED_TINY, out, "--dtype", "bf16")
    assert r.code == 0, r.err
    header = safetensors_header(out / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}

    # Every weight is its fp32 value rounded to bf16: within half a bf16 ulp (at most 2^-8 of the value).
    golden = load_file(GOLDEN_TINY / "model.safetensors")
    with open(out / "model.safetensors", "rb") as f:
        raw = f.read()
    start = 8 + int.from_bytes(raw[:8], "little")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        b, e = entry["data_offsets"]
        bits = np.frombuffer(raw[start + b:start + e], dtype="<u2").astype(np.uint32) << 16
        widened = bits.view(np.float32).reshape(entry["shape"])
        ref = golden[name]
        assert np.all(np.abs(widened - ref) <= np.abs(ref) * 2.0**-8), name

    check = run_m3check(out)
    assert check.code == 0, check.err
    assert "stored in 16 bits" in check.err
    assert 0 < check.max_rel_err <= 3e-2


def test_output_directory_must_be_new_or_empty(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert export_error(SAVE_PRETRAINED_TINY, out) == f"{out}: not empty; export into a new or empty directory"
    assert (out / "notes.txt").read_text() == "keep me"


def test_sharded_pytorch_model_bin_input_gives_the_same_model(tmp_path):
    # Shards as transformers writes them (pytorch_model.bin.index.json), of a small model
    # also saved whole; the head, tied, is in neither.
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert run_export(SAVE_PRETRAINED_TINY.parent / "small", whole).code == 0
    r = run_export(SAVE_PRETRAINED_TINY.parent / "small_sharded", sharded)
    assert r.code == 0, r.err
    a, b = load_file(whole / "model.safetensors"), load_file(sharded / "model.safetensors")
    assert set(a) == set(b) and len(a) == 14
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_the_fixture_ties_the_head_as_save_pretrained_does():
    # One storage behind backbone.embedding.weight and lm_head.weight, so the archive holds
    # one storage record fewer than the state dict has tensors.
    import zipfile

    from m3export.torch_zip import read_torch_zip
    path = SAVE_PRETRAINED_TINY / "pytorch_model.bin"
    tensors = read_torch_zip(path)
    assert np.shares_memory(tensors["lm_head.weight"].data, tensors["backbone.embedding.weight"].data)
    with zipfile.ZipFile(path) as z:
        records = [n for n in z.namelist() if "/data/" in n]
    assert len(records) == len(tensors) - 1
