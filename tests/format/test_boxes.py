"""``jckpt.format.boxes``: the arithmetic of boxes (``(start, stop)`` per dimension)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.format.boxes import (
    box_of,
    box_shape,
    box_size,
    box_slices,
    check_tiling,
    coalesce,
    full_box,
    intersect,
)

# --- box_of -------------------------------------------------------------------------------------

@pytest.mark.parametrize('index,shape,box', [
    ((slice(0, 2), slice(None)), (4, 3), ((0, 2), (0, 3))),
    ((slice(None), slice(None)), (4, 3), ((0, 4), (0, 3))),
    ((slice(1, None),), (4, 3), ((1, 4), (0, 3))),          # missing trailing dims are whole
    ((), (4, 3), ((0, 4), (0, 3))),
    ((slice(-3, -1),), (5,), ((2, 4),)),                     # negative bounds count from the end
    ((slice(-10, 10),), (5,), ((0, 5),)),                    # clipped like numpy
    ((slice(3, 1),), (5,), ((3, 3),)),                       # stop before start: empty, not inverted
    ((slice(None, None, 1),), (5,), ((0, 5),)),              # an explicit step of 1 is a box
    ((2, slice(None)), (4, 3), ((2, 3), (0, 3))),            # an integer selects one row
    ((np.int64(1),), (4,), ((1, 2),)),
    ((), (), ()),
])
def test_box_of(index, shape, box):
    assert box_of(index, shape) == box


@pytest.mark.parametrize('step', [2, -1, -2])
def test_box_of_refuses_strides(step):
    with pytest.raises(ValueError, match='strided index .* is not a box'):
        box_of((slice(None, None, step),), (6,))


def test_box_of_negative_integer_counts_from_the_end():
    assert box_of((-1,), (4,)) == ((3, 4),)


def test_box_of_integer_past_the_end_is_refused():
    with pytest.raises(IndexError):
        box_of((5,), (4,))


slice_bound = st.one_of(st.none(), st.integers(-8, 8))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=0, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.lists(st.builds(slice, slice_bound, slice_bound),
                                     max_size=len(shape)).map(tuple))))
def test_box_of_selects_what_numpy_selects(shape_and_index):
    shape, index = shape_and_index
    x = np.arange(int(np.prod(shape))).reshape(shape)
    box = box_of(index, shape)
    assert box_shape(box) == x[index].shape
    np.testing.assert_array_equal(x[box_slices(box)], x[index])


# --- slices, shapes, sizes -----------------------------------------------------------------------

def test_box_slices_shape_size_and_full_box():
    box = ((2, 4), (1, 3))
    assert box_slices(box) == (slice(2, 4), slice(1, 3))
    assert box_slices(box, origin=((2, 6), (0, 3))) == (slice(0, 2), slice(1, 3))
    assert box_shape(box) == (2, 2) and box_size(box) == 4
    assert box_size(((0, 3), (5, 5))) == 0
    assert box_size(()) == 1 and box_shape(()) == ()  # a scalar holds one element
    assert full_box((4, 0, 2)) == ((0, 4), (0, 0), (0, 2))
    assert full_box(np.array([3, 2])) == ((0, 3), (0, 2)) and full_box(()) == ()
    assert all(type(v) is int for pair in full_box(np.array([3, 2])) for v in pair)


# --- intersect ------------------------------------------------------------------------------------

@pytest.mark.parametrize('a,b,common', [
    (((0, 2), (0, 3)), ((1, 4), (2, 3)), ((1, 2), (2, 3))),
    (((0, 4),), ((1, 2),), ((1, 2),)),                        # one inside the other
    (((0, 2),), ((2, 4),), None),                             # touching is not overlapping
    (((0, 2), (0, 2)), ((0, 2), (3, 4)), None),               # disjoint in one dimension
    (((0, 2),), ((0, 2),), ((0, 2),)),
    ((), (), ()),                                             # two scalars are the same box
])
def test_intersect(a, b, common):
    assert intersect(a, b) == common
    assert intersect(b, a) == common


def test_an_empty_box_overlaps_nothing():
    assert intersect(((1, 1),), ((0, 4),)) is None


# --- coalesce -------------------------------------------------------------------------------------

def test_coalesce_joins_rows_and_keeps_what_cannot_join():
    assert coalesce([((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 2))]) == [
        ((0, 4), (0, 4)), ((4, 6), (0, 2))]
    assert coalesce([((0, 2), (0, 2)), ((2, 4), (2, 4))]) == [((0, 2), (0, 2)), ((2, 4), (2, 4))]


def test_coalesce_joins_a_grid_in_any_order_and_drops_duplicates():
    grid = [((r, r + 1), (c, c + 2)) for r in range(3) for c in (0, 2, 4)]
    assert coalesce(grid[::-1] + grid[:2]) == [((0, 3), (0, 6))]


def test_coalesce_does_not_join_across_a_gap_or_an_overlap():
    assert coalesce([((0, 2),), ((3, 4),)]) == [((0, 2),), ((3, 4),)]
    assert coalesce([((0, 3),), ((2, 4),)]) == [((0, 3),), ((2, 4),)]
    assert coalesce([]) == []


# --- check_tiling -----------------------------------------------------------------------------------

def test_exact_tilings_pass():
    assert check_tiling([((0, 2),), ((2, 4),)], (4,)) is None
    assert check_tiling([((2, 4),), ((0, 2),)], (4,)) is None  # any order
    assert check_tiling([()], ()) is None
    assert check_tiling([((0, 0), (0, 4))], (0, 4)) is None  # an empty array, one empty piece
    assert check_tiling([((0, 4),), ((4, 4),)], (4,)) is None  # an empty piece adds nothing


def test_a_gap_is_a_missing_piece():
    why = check_tiling([((0, 2),)], (4,))
    assert why == ("pieces hold 2 elements but the array has 4: a piece is missing or duplicated")


def test_a_duplicate_piece_is_an_overlap():
    assert check_tiling([((0, 2),), ((0, 2),)], (4,)) == 'pieces ((0, 2),) and ((0, 2),) overlap'
    assert check_tiling([((0, 2),), ((0, 2),), ((2, 4),)], (4,)).startswith('pieces hold 6 elements')


def test_an_overlap_hiding_a_gap_is_found():
    # the element counts agree (3 + 1 = 4), but (1, 2) lies inside (0, 3) and 3..4 is empty
    assert check_tiling([((0, 3),), ((1, 2),)], (4,)) == 'pieces ((0, 3),) and ((1, 2),) overlap'


@pytest.mark.parametrize('piece', [((0, 5),), ((-1, 1),), ((4, 6),), ((0, 2), (0, 1))])
def test_a_piece_outside_the_array_is_named(piece):
    why = check_tiling([piece, ((2, 4),)], (4,))
    assert why == f"piece {piece} lies outside the array's dims (4,)"


def test_an_overlap_among_many_pieces_is_found():
    n = 4097
    pieces = [((i, i + 1),) for i in range(n)]
    pieces[1] = pieces[0]  # element 1 is missing, element 0 is held twice: the count agrees
    assert check_tiling(pieces, (n,)) is not None


@st.composite
def grids(draw):
    """A shape and the boxes of a grid cut through it (each dimension cut at sorted points)."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    cuts = [sorted({0, d, *draw(st.lists(st.integers(1, d), max_size=3))}) for d in shape]
    boxes = [()]
    for c in cuts:
        boxes = [(*b, (lo, hi)) for b in boxes for lo, hi in itertools.pairwise(c)]
    return shape, boxes


@settings(max_examples=150, deadline=None)
@given(grids(), st.randoms(use_true_random=False))
def test_every_grid_tiles_and_coalesces_to_the_whole(grid, rnd):
    shape, boxes = grid
    rnd.shuffle(boxes)
    assert check_tiling(boxes, shape) is None
    assert coalesce(boxes) == [full_box(shape)]
    assert sum(box_size(b) for b in boxes) == box_size(full_box(shape))


@settings(max_examples=150, deadline=None)
@given(grids(), st.data())
def test_a_grid_without_one_piece_or_with_one_twice_is_refused(grid, data):
    shape, boxes = grid
    i = data.draw(st.integers(0, len(boxes) - 1))
    assert 'missing' in check_tiling(boxes[:i] + boxes[i + 1:], shape)
    if len(boxes) > 1:
        j = data.draw(st.integers(0, len(boxes) - 1).filter(lambda j: j != i))
        replaced = [boxes[j] if k == i else b for k, b in enumerate(boxes)]
        assert check_tiling(replaced, shape) is not None


def _covered_once(boxes, shape):
    """Whether every element of ``shape`` lies in exactly one of ``boxes`` (painted one by one)."""
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if box_size(b) and intersect(b, full_box(shape)) != b:
            return False
        if box_size(b):
            count[box_slices(b)] += 1
    return bool((count == 1).all())


@st.composite
def pieces_near_a_grid(draw):
    """A grid's boxes with a few changed: moved edges, pieces dropped or repeated, some empty."""
    shape, boxes = draw(grids())
    bound = st.integers(0, max(shape) + 1)
    for _ in range(draw(st.integers(0, 3))):
        if not boxes:
            break
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(shape) - 1))
        box = list(boxes[i])
        box[d] = draw(st.sampled_from([(box[d][0], draw(bound)), (draw(bound), box[d][1])]))
        what = draw(st.sampled_from(['change', 'add', 'drop']))
        if what == 'drop':
            del boxes[i]
        else:
            boxes[i:i + (what == 'change')] = [tuple(box)]
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(pieces_near_a_grid())
def test_tiling_is_decided_as_painting_every_element_decides(case):
    shape, boxes = case
    assert (check_tiling(boxes, shape) is None) == _covered_once(boxes, shape)


def test_many_pieces_tile_and_an_overlap_among_them_is_named():
    """300 x 300 one-element pieces tile; with one repeated, it is named, found with numpy
    (a crafted index repeating one piece three million times took minutes box by box)."""
    boxes = [((i, i + 1), (j, j + 1)) for i in range(300) for j in range(300)]
    assert check_tiling(boxes, (300, 300)) is None
    boxes[5] = boxes[6]
    assert check_tiling(boxes, (300, 300)) == f"piece {boxes[6]} is listed twice: pieces overlap"
    assert check_tiling(np.asarray(boxes), (300, 300)) == check_tiling(boxes, (300, 300))


@settings(max_examples=150, deadline=None)
@given(grids(), grids())
def test_intersection_lies_in_both(g1, g2):
    (s1, b1), (s2, b2) = g1, g2
    if len(s1) != len(s2):
        return
    for a in b1:
        for b in b2:
            common = intersect(a, b)
            if common is None:
                continue
            assert intersect(common, a) == common == intersect(common, b)
            assert box_size(common) > 0


def test_box_spans_of_a_box_within_a_piece():
    """The rows of a box over a piece's leading dim are one run of its bytes; a box over its
    inner dims is a run per row, joined when the rows skipped are shorter than the gap; where
    an element is not whole bytes (4-bit elements), the whole piece."""
    from jckpt.format.boxes import box_spans
    piece = ((10, 20), (0, 6))                                    # 24 bytes a row
    assert box_spans(piece, ((12, 15), (0, 6)), 240) == [(48, 72)]
    assert box_spans(piece, ((12, 15), (2, 4)), 240) == [(56, 8), (80, 8), (104, 8)]
    assert box_spans(piece, ((12, 15), (2, 4)), 240, gap=17) == [(56, 56)]
    assert box_spans(piece, ((12, 15), (2, 4)), 240, gap=16) == [(56, 8), (80, 8), (104, 8)]
    assert box_spans(piece, piece, 240) == [(0, 240)]
    assert box_spans(piece, ((12, 12), (0, 6)), 240) == []        # an empty box reads nothing
    assert box_spans(((0, 3), (0, 3)), ((1, 2), (0, 3)), 5) == [(0, 5)]
    assert box_spans((), (), 8) == [(0, 8)]


@st.composite
def _piece_and_box(draw):
    """A piece (its box in a larger array), a non-empty box within it, and an element size."""
    ndim = draw(st.integers(1, 4))
    piece, within = [], []
    for _ in range(ndim):
        start, size = draw(st.integers(0, 5)), draw(st.integers(1, 6))
        lo = draw(st.integers(start, start + size - 1))
        piece.append((start, start + size))
        within.append((lo, draw(st.integers(lo + 1, start + size))))
    return tuple(piece), tuple(within), draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=200, deadline=None)
@given(_piece_and_box(), st.integers(0, 64))
def test_box_spans_cover_exactly_the_bytes_of_the_box(case, gap):
    """Without a gap the spans are exactly the box's bytes; with one they cover them, with
    no more than the short gaps between, and every two spans are at least `gap` apart."""
    from jckpt.format.boxes import box_spans
    piece, within, item = case
    stored = np.arange(box_size(piece) * item).reshape(*box_shape(piece), item)
    want = set(stored[box_slices(within, piece)].ravel().tolist())
    spans = box_spans(piece, within, stored.size, gap)
    covered = [b for s, n in spans for b in range(s, s + n)]
    assert covered == sorted(set(covered))                       # ascending, no overlap
    assert want <= set(covered)
    if gap == 0:
        assert set(covered) == want
    assert all(b[0] - (a[0] + a[1]) >= max(gap, 1) for a, b in itertools.pairwise(spans))
    assert all(s in want and s + n - 1 in want for s, n in spans)  # each starts and ends on it
