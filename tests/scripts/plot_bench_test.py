#!/usr/bin/env python3
"""Tests scripts/plot_bench.py: PNGs from docs/bench_h200_s2s14l.json and from an
m3bench realtime report; inputs without the results it plots are refused by name."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
SCRIPT = os.path.join(ROOT, 'scripts', 'plot_bench.py')
FIGURES = os.path.join(ROOT, 'docs', 'bench_h200_s2s14l.json')
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


class PlotBenchTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def out(self, name):
        return os.path.join(self.dir.name, name)

    def assert_png(self, path):
        with open(path, 'rb') as f:
            data = f.read()
        self.assertTrue(data.startswith(PNG_MAGIC), path)
        self.assertGreater(len(data), 10_000, 'a plot with axes, lines and labels')

    def test_decode_and_compare_from_the_documented_figures(self):
        for kind in ('decode', 'compare'):
            r = run(kind, FIGURES, '--out', self.out(kind + '.png'))
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assert_png(self.out(kind + '.png'))

    def test_realtime_from_an_m3bench_report(self):
        report = {'mode': 'generate', 'rate_tokens_per_s': 100, 'slack_ms': 100, 'results': [
            {'streams': 64, 'streams_held': 64, 'lag_p99_ms': 3.0},
            {'streams': 512, 'streams_held': 512, 'lag_p99_ms': 40.0},
            {'streams': 1024, 'streams_held': 700, 'lag_p99_ms': 250.0}]}
        path = self.out('realtime.json')
        with open(path, 'w') as f:
            json.dump(report, f)
        r = run('realtime', path, '--out', self.out('realtime.png'))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_png(self.out('realtime.png'))

    def test_inputs_without_results_are_refused_by_name(self):
        path = self.out('empty.json')
        with open(path, 'w') as f:
            json.dump({'results': []}, f)
        for kind, wanted in (('decode', 'no m3bench decode results'), ('realtime', 'no m3bench realtime results')):
            r = run(kind, path, '--out', self.out('x.png'))
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(path + ': ' + wanted, r.stderr)
            self.assertFalse(os.path.exists(self.out('x.png')))
        r = run('decode', self.out('missing.json'), '--out', self.out('x.png'))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('missing.json', r.stderr)


if __name__ == '__main__':
    unittest.main()
