"""The core library's own speed checks: jckpt against raw file I/O and safetensors' numpy API.

    python -m bench.foundation            # 1 GiB in 8 arrays and 2,000 small arrays
    python -m bench.foundation --quick    # small sizes (checks that it runs)

Prints, for each workload, the ratios the core operations are held to, all
measured in one run with the tools interleaved (see ``bench/run.py``):

* durable save (fsync of file and directory) vs one raw file written and fsynced;
* load with mapping (no data touched): milliseconds whatever the size;
* load + sum of every array vs ``readinto`` of the raw file + the same sums;
* small arrays: load vs ``safetensors.numpy.load_file``; save without fsync vs
  ``safetensors.numpy.save_file`` (which never fsyncs);
* peak RSS growth of a durable save vs the arrays' size (fresh process).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from bench import report, run, workloads
from bench.tools import remove

TOOLS = ['jckpt', 'raw', 'mmap', 'st-numpy']


def checks(name: str, res: dict) -> list[tuple[str, float | None, float, str]]:
    """``(what, measured, limit, how)`` rows; ``how`` is ``'<='`` or ``'<'``."""
    m = lambda t, op: report.median(res, t, op)
    ratio = report._ratio
    rows = [
        ('durable save / raw write+fsync', ratio(m('jckpt', 'durable_save'), m('raw', 'durable_save')),
         1.15 if name == 'large' else 1.2, '<='),
        ('load (mapped) seconds', m('jckpt', 'load_host'), 0.05, '<='),
        ('load + sum / readinto + sum', ratio(m('jckpt', 'first_use'), m('raw', 'first_use')), 1.2, '<='),
    ]
    if name == 'small':
        rows += [('load / safetensors numpy load', ratio(m('jckpt', 'load_host'), m('st-numpy', 'load_host')),
                  1.0, '<'),
                 ('save, no fsync / safetensors numpy save', ratio(m('jckpt', 'save'), m('st-numpy', 'save')),
                  1.0, '<')]
    rss = res.get('rss', {}).get('jckpt', {})
    if 'save_peak' in rss:
        rows.append(('peak RSS growth of durable save, MiB', rss['save_peak'] / 2**20, 64, '<='))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--reps', type=int, default=None)
    ap.add_argument('--from-json', default=None,
                    help="read the figures from a saved bench.run result instead of measuring")
    args = ap.parse_args(argv)
    saved = None
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)['workloads']
    base = tempfile.mkdtemp(prefix='jckpt-foundation-')
    failed = 0
    try:
        for name in ('large', 'small'):
            if saved is not None:
                res = saved[name]
                reps = res['reps']
            else:
                reps = args.reps or (1 if args.quick else workloads.REPS[name])
                res = run.time_workload(name, TOOLS, reps, args.quick, base, lambda msg: None)
                res['rss'] = run.measure_rss(name, ['jckpt'], args.quick, base, lambda msg: None)
            print(f"{name}: {workloads.DESCRIPTIONS[name]} ({reps} repetitions; times include fsync "
                  "only where it says durable)")
            for what, value, limit, how in checks(name, res):
                ok = value is not None and (value <= limit if how == '<=' else value < limit)
                failed += not ok
                shown = '—' if value is None else f"{value:.3f}"
                print(f"  {what:45s} {shown:>8s}  (target {how} {limit})  {'ok' if ok else 'MISSED'}")
    finally:
        remove(base)
    return 0 if args.quick or not failed else 1


if __name__ == '__main__':
    sys.exit(main())
