"""The exporter's arithmetic and argument parsing."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from m3export.cli import parse_size
from m3export.safetensors_io import plan_shards
from m3export.tensor import DTYPES, Tensor, bf16_bits_to_f32, f32_to_bf16_bits, non_finite


def test_bf16_rounds_to_nearest_even():
    ulp = 2.0**-7  # of bf16 at 1.0
    values = np.array([1.0, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0**-20, -2.5, 0.0, -0.0,
                       np.finfo(np.float32).tiny, np.inf], dtype=np.float32)
    bits = f32_to_bf16_bits(values)
    assert bits.dtype == np.uint16
    assert list(bf16_bits_to_f32(bits)[:5]) == [1.0, 1.0, 1 + 2 * ulp, 1 + ulp, -2.5]
    assert bits[5] == 0x0000 and bits[6] == 0x8000
    assert bits[7] == 0x0080 and bits[8] == 0x7F80
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_bf16_widening_is_exact():
    bits = np.arange(0, 0x7F80, 97, dtype=np.uint16)
    assert np.array_equal(f32_to_bf16_bits(bf16_bits_to_f32(bits)), bits)


def test_non_finite_reads_bf16_bits():
    bits = np.array([0x3F80, 0x7F7F, 0x7FC0, 0xFF80, 0x7F80, 0xFFC1], dtype=np.uint16)
    t = Tensor("w", DTYPES["BF16"], bits, "f")
    assert non_finite(t) == (2, 2, (2,))
    assert non_finite(Tensor("w", DTYPES["BF16"], bits[:2], "f")) == (0, 0, None)


def test_shard_sizes():
    assert parse_size("300KB") == 300_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size("4096") == 4096
    for bad in ("", "0", "2 parsecs", "-5MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_shard_plan_keeps_order_and_puts_a_large_tensor_alone():
    sizes = [("a", 40), ("b", 50), ("c", 200), ("d", 10), ("e", 90), ("f", 5)]
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert plan_shards(sizes, None) == [["a", "b", "c", "d", "e", "f"]]


def test_bf16_conversion_in_chunks_equals_whole(monkeypatch):
    import m3export.tensor as tensor
    x = np.random.default_rng(1).standard_normal((13, 5)).astype(np.float32)
    x[2, 3] = np.nan
    whole = f32_to_bf16_bits(x)
    monkeypatch.setattr(tensor, "_CHUNK", 7)
    chunked = f32_to_bf16_bits(x)
    assert chunked.shape == (13, 5)
    assert np.array_equal(chunked, whole)
