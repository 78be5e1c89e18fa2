"""Where a save and a restore of many small arrays spend their time: the top functions by own time.

`python -m bench.profile_small [small|tiny] [save|durable|restore] [top]` profiles one
operation (after a warm-up) with `cProfile` and prints its top entries, the
per-leaf costs docs/benchmarks.md quotes.

The tree and the target are the ones `bench.run` times: `jax.Array`s on the default
device, and a target of `jax.ShapeDtypeStruct`s that carry each array's sharding
(every leaf its own sharding object, all equal).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile

import jax

import jckpt
from bench import workloads
from bench.run import spec_of, to_device


def main(workload: str = 'small', op: str = 'save', top: int = 12) -> None:
    tree = to_device(workloads.build(workload, quick=False))
    spec = spec_of(tree)
    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    path = os.path.join(scratch.name, 'p.jckpt')
    ctx = jckpt.Context(durable=op == 'durable')
    jckpt.save(ctx, tree, path)
    run = {'save': lambda: jckpt.save(ctx, tree, path),
           'durable': lambda: jckpt.save(ctx, tree, path),
           'restore': lambda: jax.block_until_ready(jckpt.restore(ctx, spec, path))}[op]
    run()
    profile = cProfile.Profile()
    profile.runcall(run)
    stats = pstats.Stats(profile)
    stats.sort_stats('tottime').print_stats(top)


if __name__ == '__main__':
    main(*sys.argv[1:3], *[int(a) for a in sys.argv[3:4]])
