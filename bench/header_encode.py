"""Header encoding of many entries: the C accelerator against the pure-Python encoder, one run.

`python -m bench.header_encode [small|tiny ...] [--reps N]` saves the workload once, reads
its header back (so the entries are exactly a save's), then times
`encode_header_with_slots` (what a save calls, twice) with the accelerator and, in the same
process, with it disabled, and checks that both give the same bytes. Medians of N runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import jckpt
from bench import workloads
from bench.run import clock
from jckpt.format import decode_header, fastpath
from jckpt.format.header import Header, encode_header_with_slots


def saved_header(name: str) -> Header:
    """The header of the workload as `jckpt.save` writes it."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'h.jckpt')
        jckpt.save(jckpt.Context(durable=False), workloads.build(name, quick=False), path)
        with open(path, 'rb') as f:
            first = f.read(4)
            return decode_header(first + f.read(int.from_bytes(first, 'big')))


def median_s(header: Header, reps: int) -> float:
    """Median seconds of `encode_header_with_slots(header)`."""
    return statistics.median(clock(encode_header_with_slots, header)[0] for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('workloads', nargs='*', default=['small', 'tiny'])
    parser.add_argument('--reps', type=int, default=9)
    args = parser.parse_args()
    accelerator = fastpath.accelerator
    if getattr(accelerator, 'encode_entries', None) is None:
        print("the C accelerator is not built: only the Python encoder can be timed")
    for name in args.workloads:
        header = saved_header(name)
        fast = median_s(header, args.reps)
        expected = encode_header_with_slots(header)
        fastpath.accelerator = None
        try:
            slow = median_s(header, args.reps)
            assert encode_header_with_slots(header) == expected, "the two encoders disagree"
        finally:
            fastpath.accelerator = accelerator
        n = len(header.tensors)
        print(f"{name}: {n:,} entries, {len(expected[0]):,} header bytes: "
              f"C {fast * 1e3:.2f} ms ({fast / n * 1e9:.0f} ns/entry), "
              f"Python {slow * 1e3:.2f} ms ({slow / n * 1e9:.0f} ns/entry), {slow / fast:.1f}x")


if __name__ == '__main__':
    main()
