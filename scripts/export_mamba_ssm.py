#!/usr/bin/env python3
"""Exports a mamba-ssm checkpoint to an m3serve model directory.

  scripts/export_mamba_ssm.py SRC OUT [--dtype bf16|fp32] [--shard-size SIZE]

Needs numpy and safetensors (scripts/requirements-export.txt); torch is optional. See
scripts/m3export/ for the rules and README.md ("From a trained checkpoint to serving it").
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from m3export.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
