#!/usr/bin/env python3
"""Per-layer kernel times inside m3bench's decode graph, from m3_kernel_trace's CSV.

Usage: kernel_trace_summary.py TRACE.csv[.gz] [--chains C] [--layer-kernels K]

Keeps the records of the last CUDA graph replayed (the bucket's own: the engine's
load-time measurement of step variants replays other graphs first, and m3bench's direct
launches after it carry no graph id), groups them into replays (each ends with its
chains' sampling kernels; --chains for split buckets), drops the first quarter as
warm-up, and prints per kernel position the median start, end and duration relative to
the replay's first kernel, and the time from the previous kernel's end to this one's end
(with programmatic dependent launch a kernel starts before its predecessor ends, so that
increment, not the duration, is what the kernel adds to the step). Last, the mean increment
of each of the K kernels of a layer over the middle layers; K is detected as the period of
the kernels (name and grid) before lm_head, after the embedding kernel where there is one
(the first in_proj gathers the embedding rows itself unless the step variant has an embedding kernel):
3 in most buckets, 2 where out_proj runs inside the recurrence; two chains side by side
have none: pass K.
"""
import argparse
import csv
import gzip
import statistics


def short_name(name):
    for kind in ('embedding', 'gemv_mma_rows', 'gemv_mma', 'gemv_kernel', 'mimo_step_tc', 'mimo_step', 'sampling'):
        if kind in name:
            return kind
    return name[:24]


def layer_period(replay, head):
    """The smallest K such that the kernels after the first `head` (the embedding kernel,
    if any) and before lm_head and sampling (the last two) repeat every K, or 0."""
    body = [(short_name(r['name']), r['grid_x'], r['grid_y']) for r in replay[head:-2]]
    for k in range(1, len(body) // 2 + 1):
        if len(body) % k == 0 and all(body[i] == body[i % k] for i in range(len(body))):
            return k
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('trace')
    ap.add_argument('--chains', type=int, default=1, help='chains side by side (sampling kernels a replay)')
    ap.add_argument('--layer-kernels', type=int, default=0, help='kernels per layer (default: detected)')
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith('.gz') else open
    with opener(args.trace, 'rt') as f:
        rows = [r for r in csv.DictReader(f) if r['graph'] != '0']
    if not rows:
        raise SystemExit(f'{args.trace}: no kernel records from a CUDA graph')
    rows.sort(key=lambda r: int(r['start_ns']))
    last_graph = rows[-1]['graph']
    rows = [r for r in rows if r['graph'] == last_graph]
    replays, current, seen = [], [], 0
    for r in rows:
        current.append(r)
        if 'sampling' in r['name']:
            seen += 1
            if seen == args.chains:
                replays.append(current)
                current, seen = [], 0
    if len(replays) < 2:
        raise SystemExit('fewer than two replays found (wrong --chains?)')
    per = len(replays[0])
    replays = [rep for rep in replays if len(rep) == per]
    replays = replays[len(replays) // 4:]

    def at(rep, i, key):
        return (int(rep[i][key]) - int(rep[0]['start_ns'])) / 1e3

    step = statistics.median(max(at(r, i, 'end_ns') for i in range(per)) for r in replays)
    print(f'{len(replays)} replays of {per} kernels, step {step:.2f} us (median; tracing adds a few us)')
    print(f'{"pos":>3} {"kernel":<14} {"grid":>9} {"start":>8} {"end":>8} {"dur":>7} {"end-prev end":>13}')
    increments = []
    for i in range(per):
        start = statistics.median(at(r, i, 'start_ns') for r in replays)
        end = statistics.median(at(r, i, 'end_ns') for r in replays)
        dur = statistics.median(at(r, i, 'end_ns') - at(r, i, 'start_ns') for r in replays)
        inc = statistics.median(at(r, i, 'end_ns') - (at(r, i - 1, 'end_ns') if i else 0.0) for r in replays)
        increments.append(inc)
        r0 = replays[0][i]
        grid = f'{r0["grid_x"]}x{r0["grid_y"]}'
        print(f'{i:3d} {short_name(r0["name"]):<14} {grid:>9} {start:8.2f} {end:8.2f} {dur:7.2f} {inc:13.2f}')
    head = 1 if 'embedding' in replays[0][0]['name'] else 0
    k = args.layer_kernels if args.layer_kernels > 0 else layer_period(replays[0], head)
    if k <= 0:
        raise SystemExit('cannot detect the kernels of a layer (two chains?); pass --layer-kernels')
    layers = (per - head - 2) // k  # lm_head and sampling last
    middle = range(head + k, head + k * (layers - 1))  # skip the first and last layer
    print('per layer (middle layers), end-to-end increment:')
    for j in range(k):
        vals = [increments[i] for i in middle if (i - head) % k == j]
        if vals:
            print(f'  {short_name(replays[0][head + j]["name"])}: {sum(vals) / len(vals):.2f} us')


if __name__ == '__main__':
    main()
