#!/usr/bin/env python3
"""m3bench's JSON as the plots a reader would rather look at than read.

Usage:
  plot_bench.py decode BENCH.json [BENCH.json ...] --out step_vs_batch.png
      us per step and the memory-bandwidth floor against batch (m3bench decode --json;
      several files: one line each, labelled by their "label" or file name)
  plot_bench.py realtime REALTIME.json [REALTIME.json ...] --out streams.png
      streams held in real time against N (m3bench realtime --json), the p99 lag beside
  plot_bench.py compare FIGURES.json --out vs_mamba_ssm.png
      m3serve's step against mamba-ssm's at the batches both were measured at
      (FIGURES.json: {"decode": <m3bench decode JSON>, "mamba_ssm": {"results": [{"batch",
      "us_per_step"}]}})

A file for `decode` may also be such a FIGURES.json (its "decode" is read). Needs
matplotlib (Debian: apt-get install python3-matplotlib; run with /usr/bin/python3).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f'plot_bench.py: {path}: {e}')


def decode_rows(doc, path):
    doc = doc.get('decode', doc)
    rows = doc.get('results')
    if not rows or any('batch' not in r or 'graph_us_per_step' not in r for r in rows):
        sys.exit(f'plot_bench.py: {path}: no m3bench decode results (results[].batch, graph_us_per_step)')
    return doc, sorted(rows, key=lambda r: r['batch'])


def label_of(doc, path):
    return doc.get('label') or os.path.splitext(os.path.basename(path))[0]


def plot_decode(paths, out):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in paths:
        doc, rows = decode_rows(load(path), path)
        batches = [r['batch'] for r in rows]
        label = label_of(doc, path)
        ax.plot(batches, [r['graph_us_per_step'] for r in rows], 'o-', label=f'{label}: us per step')
        if all('floor_us' in r for r in rows):
            ax.plot(batches, [r['floor_us'] for r in rows], 's--', label=f'{label}: floor (bytes / copy bandwidth)')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f'{v:g}'))
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f'{v:g}' if str(f'{v:g}')[0] in '1235' else ''))
    ax.set_xlabel('batch (sequences a step)')
    ax.set_ylabel('us per decode step')
    ax.set_title('Decode step against batch')
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_realtime(paths, out):
    fig, (held_ax, lag_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    largest, slack = 0, None
    for path in paths:
        doc = load(path)
        rows = sorted(doc.get('results') or [], key=lambda r: r.get('streams', 0))
        if not rows or any('streams' not in r or 'streams_held' not in r for r in rows):
            sys.exit(f'plot_bench.py: {path}: no m3bench realtime results (results[].streams, streams_held)')
        n = [r['streams'] for r in rows]
        largest = max(largest, max(n))
        label = f"{label_of(doc, path)} ({doc.get('mode', '?')}, {doc.get('rate_tokens_per_s', '?')} tokens/s)"
        held_ax.plot(n, [r['streams_held'] for r in rows], 'o-', label=label)
        lag_ax.plot(n, [r['lag_p99_ms'] for r in rows], 'o-')
        slack = doc.get('slack_ms', slack)
    held_ax.plot([0, largest], [0, largest], ':', color='gray', label='every stream held')
    held_ax.set_xlabel('streams (N)')
    held_ax.set_ylabel('streams that stayed ahead of real time')
    held_ax.set_title('Streams held against N')
    lag_ax.set_xlabel('streams (N)')
    lag_ax.set_ylabel('p99 lag behind real time (ms)')
    lag_ax.set_yscale('log')  # a few ms to seconds
    if slack is not None:
        lag_ax.axhline(slack, color='red', linestyle='--', label=f'slack {slack:g} ms')
        lag_ax.legend(fontsize=8)
    lag_ax.set_title('Lag p99 against N')
    for ax in (held_ax, lag_ax):
        ax.grid(True, alpha=0.3)
    # One legend for both panels, below them: inside, it covered the lines.
    handles, labels = held_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc='lower center', ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(out, dpi=120)


def plot_compare(path, out):
    doc = load(path)
    _, rows = decode_rows(doc, path)
    theirs = {r['batch']: r['us_per_step'] for r in doc.get('mamba_ssm', {}).get('results', [])}
    ours = {r['batch']: r['graph_us_per_step'] for r in rows}
    batches = sorted(set(theirs) & set(ours))
    if not batches:
        sys.exit(f'plot_bench.py: {path}: no batch measured for both m3serve and mamba_ssm')
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x = range(len(batches))
    width = 0.38
    bars_ours = ax.bar([i - width / 2 for i in x], [ours[b] for b in batches], width, label='m3serve')
    bars_theirs = ax.bar([i + width / 2 for i in x], [theirs[b] for b in batches], width,
                         label=doc['mamba_ssm'].get('label', 'mamba-ssm'))
    for bars in (bars_ours, bars_theirs):
        ax.bar_label(bars, fmt='%.0f', fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f'batch {b}' for b in batches])
    ax.set_ylabel('us per decode step')
    ax.set_title(doc.get('compare_title', 'm3serve against mamba-ssm'))
    ax.legend(fontsize=8)
    ax.grid(True, axis='y', alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv):
    parser = argparse.ArgumentParser(description='Plots from m3bench JSON.')
    parser.add_argument('kind', choices=['decode', 'realtime', 'compare'])
    parser.add_argument('inputs', nargs='+')
    parser.add_argument('--out', required=True, help='PNG to write')
    args = parser.parse_args(argv)
    if args.kind == 'decode':
        plot_decode(args.inputs, args.out)
    elif args.kind == 'realtime':
        plot_realtime(args.inputs, args.out)
    else:
        if len(args.inputs) != 1:
            sys.exit('plot_bench.py: compare takes one FIGURES.json')
        plot_compare(args.inputs[0], args.out)


if __name__ == '__main__':
    main(sys.argv[1:])
