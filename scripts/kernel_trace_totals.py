#!/usr/bin/env python3
"""Total time and count of each kernel in an m3_kernel_trace CSV, largest first.

Usage: kernel_trace_totals.py TRACE.csv[.gz] [--top N]

For runs that are not one decode graph (m3bench prefill, say), where
kernel_trace_summary.py's per-layer view does not apply: kernels are grouped by name and
grid, so that one kernel's launches at different sizes stay apart. Last, for the kernels
launched outside CUDA graphs (a prefill's), the time the GPU sat between one and the next
where that gap was under a millisecond (inside one call): what launches and hand-offs cost.
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
    loose = []  # (start, end, name) of the kernels outside graphs
    with opener(args.trace, "rt") as f:
        for row in csv.reader(f):
            if len(row) < 7 or not row[0].isdigit():
                continue
            start, end, gx, gy, bx = int(row[0]), int(row[1]), row[2], row[3], row[4]
            name = ",".join(row[6:])
            key = "%s [grid %sx%s, block %s]" % (name[:90], gx, gy, bx)
            total[key] += end - start
            count[key] += 1
            if row[5] == "0":
                loose.append((start, end, name[:90]))
    all_ns = sum(total.values())
    print("%10s %7s %9s %6s  kernel" % ("total ms", "count", "mean us", "share"))
    for key, ns in total.most_common(args.top):
        print("%10.3f %7d %9.2f %5.1f%%  %s" % (ns / 1e6, count[key], ns / 1e3 / count[key], 100 * ns / all_ns, key))
    loose.sort()
    busy = sum(k[1] - k[0] for k in loose)
    gap_before = collections.defaultdict(list)  # the kernel that starts after the gap
    for a, b in zip(loose, loose[1:]):
        if 0 <= b[0] - a[1] < 1_000_000:
            gap_before[b[2]].append(b[0] - a[1])
    gaps = [g for v in gap_before.values() for g in v]
    if loose:
        print("outside graphs: %d kernels, %.3f ms busy, %.3f ms in %d gaps under 1 ms (mean %.2f us)"
              % (len(loose), busy / 1e6, sum(gaps) / 1e6, len(gaps), sum(gaps) / 1e3 / max(1, len(gaps))))
        print("%10s %7s %9s  the gap before" % ("gaps ms", "count", "mean us"))
        for name, v in sorted(gap_before.items(), key=lambda kv: -sum(kv[1]))[:12]:
            print("%10.3f %7d %9.2f  %s" % (sum(v) / 1e6, len(v), sum(v) / 1e3 / len(v), name))


if __name__ == "__main__":
    main()
