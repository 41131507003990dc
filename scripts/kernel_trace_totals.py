#!/usr/bin/env python3
"""Total time and count of each kernel in an m3_kernel_trace CSV, largest first.

Usage: kernel_trace_totals.py TRACE.csv[.gz] [--top N]

For runs that are not one decode graph (m3bench prefill, say), where
kernel_trace_summary.py's per-layer view does not apply: kernels are grouped by name and
grid, so that one kernel's launches at different sizes stay apart.
"""
import argparse
import collections
import csv
import gzip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    total = collections.Counter()
    count = collections.Counter()
    with opener(args.trace, "rt") as f:
        for row in csv.reader(f):
            if len(row) < 7 or not row[0].isdigit():
                continue
            start, end, gx, gy, bx = int(row[0]), int(row[1]), row[2], row[3], row[4]
            name = ",".join(row[6:])
            key = "%s [grid %sx%s, block %s]" % (name[:90], gx, gy, bx)
            total[key] += end - start
            count[key] += 1
    all_ns = sum(total.values())
    print("%10s %7s %9s %6s  kernel" % ("total ms", "count", "mean us", "share"))
    for key, ns in total.most_common(args.top):
        print("%10.3f %7d %9.2f %5.1f%%  %s" % (ns / 1e6, count[key], ns / 1e3 / count[key], 100 * ns / all_ns, key))


if __name__ == "__main__":
    main()
