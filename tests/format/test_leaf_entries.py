"""`jckpt.format.leaf_entries.build`: runs of small host leaves in C, stopping where Python must take over.

That C and Python build equal entries, sources and files for any tree is
checked from the saving side, in `tests/api/test_saving.py`.
"""

import numpy as np
import pytest

from jckpt.format import leaf_entries
from jckpt.format.entries import entry_for
from jckpt.format.payload import checksum

LIMIT = 1 << 16


class Source(tuple):
    """A 2-tuple type standing for the storage layer's payload source."""

    __slots__ = ()


def leaf(array, dtype=None):
    return (dtype or array.dtype, array.shape, None, array)


def build(hosts, **kw):
    entries, sources = [], []
    args = dict(start=0, first_id=7, cursor=0, alignment=64, small_limit=LIMIT, source_type=Source,
                entries=entries, sources=sources) | kw
    stop, cursor = leaf_entries.build("jckpt", [(("k", str(i)),) for i in range(len(hosts))], hosts, **args)
    return stop, cursor, entries, sources


needs_c = pytest.mark.skipif(leaf_entries.accelerator is None, reason="the C accelerator is not built")


@needs_c
def test_small_leaves_are_built_with_their_checksum_and_laid_out():
    a, b = np.arange(3, dtype=np.int8), np.ones((2, 2), np.float32)
    stop, cursor, entries, sources = build([leaf(a), leaf(b)])
    assert (stop, cursor) == (2, 64 + 16)
    assert entries[1] == entry_for("jckpt", (("k", "1"),), b.dtype, b.shape, id=8, offset=64,
                                   checksum=checksum(b.view(np.uint8).reshape(-1)))
    assert type(sources[0]) is Source and sources[0][0].tobytes() == a.tobytes()
    assert sources[0][1] == entries[0].checksum


@needs_c
@pytest.mark.parametrize("odd", [
    leaf(np.zeros(LIMIT, np.int8)),                       # at the small limit: streamed, not built here
    leaf(np.zeros((4, 4), np.float32)[:, ::2]),           # not contiguous
    leaf(np.zeros((3, 2), np.float32, order="F")),        # Fortran order
    leaf(np.zeros(2, ">f4"), np.dtype("float32")),        # big-endian
    (np.dtype("float32"), (2,), None, None),              # sharded: no whole array
    (np.dtype("U3"), (1,), None, np.array(["abc"])),      # not a storable dtype
])
def test_a_run_stops_at_a_leaf_it_leaves_to_python(odd):
    small = leaf(np.arange(3, dtype=np.int8))
    stop, cursor, entries, sources = build([small, odd, small])
    assert (stop, cursor, len(entries), len(sources)) == (1, 3, 1, 1)
    assert build([small, odd, small], start=2, cursor=100, first_id=9)[:2] == (3, 131)


def test_without_the_accelerator_nothing_is_built(monkeypatch):
    monkeypatch.setattr(leaf_entries, "accelerator", None)
    assert build([leaf(np.zeros(2))], cursor=5)[:3] == (0, 5, [])
