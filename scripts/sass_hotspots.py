#!/usr/bin/env python3
"""The SASS instructions where a kernel's warps wait longest, from Nsight Compute's source page.

Reads the CSV that `ncu -i REP --page source --csv --print-source sass` prints (gzip or plain;
scripts/device_check.sh prefill_sass writes one per chunk kernel) and lists the instructions
with the most warp-stall samples, each with its share, the running share and the stall
reasons that ncu breaks it into.

    scripts/sass_hotspots.py device-out/prefill_sass_prefill_chunk_output.csv.gz [--top 40]
"""
import argparse
import csv
import gzip
import io
import sys


def open_text(path):
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return io.StringIO(raw.decode("utf-8", "replace"))


def rows_of(path):
    """The CSV's rows from its header line on (ncu may print notes before it)."""
    lines = open_text(path).read().splitlines()
    start = next((i for i, l in enumerate(lines) if "Source" in l and "," in l), None)
    if start is None:
        sys.exit(f"{path}: no header line with a 'Source' column")
    return list(csv.DictReader(lines[start:]))


def number(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    rows = rows_of(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no instructions")
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    if total_col is None:
        sys.exit(f"{args.csv}: no 'Warp Stall Sampling (All Samples)' column; columns: {cols}")
    reason_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    addr_col = next((c for c in cols if c.strip().lower() == "address"), cols[0])
    total = sum(number(r[total_col]) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} warp-stall samples")
    ranked = sorted(rows, key=lambda r: -number(r[total_col]))
    running = 0.0
    for r in ranked[: args.top]:
        n = number(r[total_col])
        running += n
        reasons = sorted(((number(r[c]), c) for c in reason_cols), reverse=True)[:2]
        why = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for v, c in reasons if v > 0)
        print(f"{n / total:6.1%} {running / total:6.1%}  {r[addr_col]:>6}  {r['Source'][:70]:70}  {why}")


if __name__ == "__main__":
    main()
