#!/usr/bin/env python3
"""Tests scripts/kernel_trace_summary.py on synthetic m3_kernel_trace CSVs."""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'scripts', 'kernel_trace_summary.py')
KINDS = ['gemv_kernel', 'mimo_step_tc', 'gemv_kernel']  # in_proj, recurrence, out_proj
INCREMENTS_US = [2.5, 4.75, 1.75]                        # end-to-end time each adds


def write_trace(path, replays, layers=14, graph=7, no_graph_replays=2, kinds=KINDS, increments=INCREMENTS_US,
                embedding=True, t0=1_000_000_000, append=False):
    """Replays of embedding (if `embedding`), `layers` x `kinds` (in_proj, recurrence,
    out_proj), lm_head, sampling. Each kernel starts 3 us before its predecessor ends (early
    launch) and ends the given increment after it. In_proj and out_proj differ by their grids."""
    head = ['embedding_kernel'] if embedding else []
    names = head + list(kinds) * layers + ['gemv_kernel', 'sampling_kernel']
    grids = [4] * len(head) + [296 if i == 0 else 56 for i in range(len(kinds))] * layers + [256, 1]
    incs = [1.5] * len(head) + list(increments) * layers + [2.0, 2.5]
    with open(path, 'a' if append else 'w') as f:
        if not append:
            f.write('start_ns,end_ns,grid_x,grid_y,block_x,graph,name\n')
        t = t0
        for r in range(replays + no_graph_replays):
            g = graph if r >= no_graph_replays else 0
            prev_end = t
            for name, grid, inc in zip(names, grids, incs):
                end = prev_end + int(inc * 1000)
                start = max(t, prev_end - 3000)
                f.write(f'{start},{end},{grid},1,256,{g},_ZN2m37kernels{name}EEv\n')
                prev_end = end
            t = prev_end + 5000


def layer_increments(stdout):
    """The per-layer increments the script prints last, in order."""
    tail = stdout.split('per layer (middle layers), end-to-end increment:')[1].split('\n')
    return [float(line.split(':')[1].split()[0]) for line in tail if ':' in line]


class KernelTraceSummaryTest(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def assert_summary_of_eight_default_replays(self, path):
        out = self.run_script(path)
        self.assertEqual(out.returncode, 0, out.stderr)
        step = 1.5 + 14 * sum(INCREMENTS_US) + 2.0 + 2.5
        # 8 replays, the first quarter dropped as warm-up; the no-graph records ignored.
        self.assertIn(f'6 replays of 45 kernels, step {step:.2f} us', out.stdout)
        self.assertEqual(layer_increments(out.stdout), INCREMENTS_US)

    def test_per_layer_increments_and_step(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, 'trace.csv')
            write_trace(path, replays=8)
            self.assert_summary_of_eight_default_replays(path)

    def test_detects_two_kernel_layers(self):  # out_proj inside the recurrence (batch 1)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, 'trace.csv')
            write_trace(path, replays=8, kinds=KINDS[:2], increments=[2.9, 4.6])
            out = self.run_script(path)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn('6 replays of 31 kernels', out.stdout)
            self.assertEqual(layer_increments(out.stdout), [2.9, 4.6])

    def test_step_without_an_embedding_kernel(self):  # the first in_proj gathers the rows
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, 'trace.csv')
            write_trace(path, replays=8, kinds=KINDS[:2], increments=[2.9, 4.6], embedding=False)
            out = self.run_script(path)
            self.assertEqual(out.returncode, 0, out.stderr)
            step = 14 * (2.9 + 4.6) + 2.0 + 2.5
            self.assertIn(f'6 replays of 30 kernels, step {step:.2f} us', out.stdout)
            self.assertEqual(layer_increments(out.stdout), [2.9, 4.6])

    def test_reads_the_last_graph_only(self):  # the load-time candidates' replays come first
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, 'trace.csv')
            write_trace(path, replays=12, graph=3, kinds=KINDS[:2], increments=[2.9, 4.6])
            write_trace(path, replays=8, t0=2_000_000_000, append=True)
            self.assert_summary_of_eight_default_replays(path)

    def test_refuses_a_trace_without_graph_records(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, 'trace.csv')
            write_trace(path, replays=0)
            out = self.run_script(path)
            self.assertNotEqual(out.returncode, 0)
            self.assertIn('no kernel records from a CUDA graph', out.stderr)


if __name__ == '__main__':
    unittest.main()
