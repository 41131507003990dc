"""Shared paths and runners of the exporter's tests.

ctest runs them in the exporter's virtual environment (tests/scripts/CMakeLists.txt) with
M3CHECK set to the built m3check; by hand:
  M3CHECK=build/model/m3check build/export-venv/bin/python -m pytest tests/scripts/export
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "export_mamba_ssm.py"
DATA = REPO / "tests" / "data"
GOLDEN_TINY = DATA / "golden_tiny"
TRAJECTORY = GOLDEN_TINY / "trajectory.safetensors"
TORCH_FIXTURES = DATA / "torch_checkpoints"
SAVE_PRETRAINED_TINY = TORCH_FIXTURES / "mamba_ssm_tiny"

sys.path.insert(0, str(REPO / "scripts"))


@dataclass
class Run:
    code: int
    out: str
    err: str


def run_export(*args: object) -> Run:
    p = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)
    return Run(p.returncode, p.stdout, p.stderr)


def export_error(*args: object) -> str:
    """The exporter's one-line error (without its "export_mamba_ssm: " prefix); asserts it failed."""
    r = run_export(*args)
    assert r.code == 1, f"exit {r.code}\nstdout: {r.out}\nstderr: {r.err}"
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export_mamba_ssm: "), r.err
    return lines[0][len("export_mamba_ssm: "):]


@dataclass
class Check:
    code: int
    max_rel_err: float
    greedy_match: bool
    err: str


def m3check_path() -> Path:
    path = os.environ.get("M3CHECK")
    if not path:
        pytest.skip("M3CHECK is not set (ctest sets it to the built m3check)")
    return Path(path)


def run_m3check(model_dir: Path, *extra: str) -> Check:
    p = subprocess.run([str(m3check_path()), str(model_dir), str(TRAJECTORY), "--backend", "cpu", *extra],
                       capture_output=True, text=True)
    m = re.fullmatch(r"max_rel_err=(\S+) greedy_match=(yes|no)\n", p.stdout)
    if not m:
        return Check(p.returncode, float("nan"), False, p.stderr)
    return Check(p.returncode, float(m.group(1)), m.group(2) == "yes", p.stderr)


def m3check_error(model_dir: Path) -> str:
    """m3check's load error for `model_dir` (without its "m3check: " prefix); asserts it refused."""
    p = subprocess.run([str(m3check_path()), str(model_dir), str(TRAJECTORY), "--backend", "cpu"],
                       capture_output=True, text=True)
    assert p.returncode == 3, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("m3check: "), p.stderr
    return line[len("m3check: "):]


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))
