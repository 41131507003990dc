"""Command line of scripts/export_mamba_ssm.py."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .checkpoint import PICKLE_READERS
from .errors import ExportError
from .export import OUTPUT_DTYPES, export

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """Bytes from "2GB" (10^9), "500MiB" (2^20), "123456" and the like."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (bytes, or a number with KB, MB, GB, KiB, MiB or GiB)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard size must be positive")
    return size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="export_mamba_ssm.py",
        description="Export a mamba-ssm checkpoint directory (config.json with pytorch_model.bin as "
                    "save_pretrained writes it, model.safetensors, or sharded safetensors with "
                    "model.safetensors.index.json) to an m3serve model directory. Every tensor is "
                    "checked against the config first; nothing from the checkpoint is executed.")
    p.add_argument("src", type=Path, metavar="SRC", help="checkpoint directory")
    p.add_argument("out", type=Path, metavar="OUT", help="model directory to write (new or empty)")
    p.add_argument("--dtype", choices=sorted(OUTPUT_DTYPES), default="fp32",
                   help="dtype of the written weights (default fp32: exact)")
    p.add_argument("--shard-size", type=parse_size, default=None, metavar="SIZE",
                   help="write shards of at most SIZE (e.g. 2GB, 500MiB) with model.safetensors.index.json; "
                        "default: one model.safetensors")
    p.add_argument("--pickle-reader", choices=PICKLE_READERS, default="auto",
                   help="pytorch_model.bin through torch.load(weights_only=True) (torch), the built-in "
                        "reader of torch's zip format (restricted), or torch where installed (auto)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        export(args.src, args.out, dtype=args.dtype, shard_size=args.shard_size, pickle_reader=args.pickle_reader,
               log=lambda line: print(f"export_mamba_ssm: {line}"))
    except ExportError as e:
        print(f"export_mamba_ssm: {e}", file=sys.stderr)
        return 1
    return 0
