"""``jckpt.format.names``: reserved file names round-trip through their patterns, and nothing else does."""

import pytest

from jckpt.format import names
from jckpt.format.names import (
    INDEX_NAME,
    KNOWN_KEYS,
    LEASE_SUFFIX,
    NEXT_TAG,
    PIECE_RE,
    RESERVED_PREFIX,
    STAGE_DIR_TAG,
    STAGE_TAG,
    STEP_RE,
    piece_name,
    piece_tag,
    save_tag,
    step_name,
    tag_writer,
)

# --- steps ------------------------------------------------------------------------------------------

@pytest.mark.parametrize('step,name', [
    (0, 'step_00000000.jckpt'),
    (100, 'step_00000100.jckpt'),
    (99_999_999, 'step_99999999.jckpt'),
    (100_000_000, 'step_100000000.jckpt'),  # past eight digits the name grows
    (10**15, 'step_1000000000000000.jckpt'),
])
def test_step_name_round_trips(step, name):
    assert step_name(step) == name
    m = STEP_RE.match(name)
    assert m is not None and int(m.group(1)) == step


def test_step_names_sort_as_their_steps_within_eight_digits():
    steps = [0, 7, 10, 99, 12_345, 99_999_999]
    assert sorted(step_name(s) for s in reversed(steps)) == [step_name(s) for s in steps]


@pytest.mark.parametrize('name', [
    'step_0000100.jckpt',                              # seven digits
    'step_00000100.jckpt\n',                           # \Z: no trailing newline
    'step_00000100.JCKPT',
    'step_00000100.jckpt.tmp',
    'step_00000100',
    'xstep_00000100.jckpt',
    'step_-0000001.jckpt',
    'step_0000010a.jckpt',
    step_name(100) + STAGE_TAG + '0000abcd.00000001.0123456789abcdef',
    step_name(100) + STAGE_DIR_TAG + '0123456789abcdef',
    step_name(100) + NEXT_TAG + '4',
    step_name(100) + LEASE_SUFFIX,
    INDEX_NAME,
    piece_name(0),
])
def test_what_is_not_a_step(name):
    assert STEP_RE.match(name) is None


def test_non_ascii_digits_are_not_a_step():
    assert STEP_RE.match('step_' + '\u0661' + '\u0660' * 7 + '.jckpt') is None


# --- pieces of a directory checkpoint -------------------------------------------------------------

@pytest.mark.parametrize('process,layer,name', [
    (0, 0, 'process_00000.jckpt'),
    (12, 1, 'process_00012.1.jckpt'),
    (3, 17, 'process_00003.17.jckpt'),
    (99_999, 0, 'process_99999.jckpt'),
    (123_456, 2, 'process_123456.2.jckpt'),  # more than five digits of process
])
def test_piece_name_round_trips(process, layer, name):
    assert piece_name(process, layer) == name
    m = PIECE_RE.match(name)
    assert m is not None and int(m.group(1)) == process
    assert (int(m.group(2)) if m.group(2) else 0) == layer


def test_layer_zero_is_the_plain_name():
    assert piece_name(4) == piece_name(4, 0) == 'process_00004.jckpt'
    assert PIECE_RE.match(piece_name(4)).group(2) is None


TAG = save_tag(0xDEADBEEF, 4242, 0x12)


@pytest.mark.parametrize('process,layer,name', [
    (0, 0, f'process_00000.{TAG}.jckpt'),
    (12, 1, f'process_00012.1.{TAG}.jckpt'),
    (123_456, 2, f'process_123456.2.{TAG}.jckpt'),
])
def test_tagged_piece_names_round_trip(process, layer, name):
    """In an object store each save names its pieces with its tag, after the layer."""
    assert TAG == 'sdeadbeef0000109200000012'
    assert piece_name(process, layer, TAG) == name
    m = PIECE_RE.match(name)
    assert (int(m.group(1)), int(m.group(2) or 0), m.group(3)) == (process, layer, TAG)
    assert piece_tag(name) == TAG and tag_writer(TAG) == (0xDEADBEEF, 4242)


def test_untagged_pieces_and_other_names_have_no_tag():
    assert piece_tag(piece_name(3, 2)) == '' and piece_tag(INDEX_NAME) is None
    assert tag_writer('s' + '0' * 23) is None and tag_writer('1') is None


@pytest.mark.parametrize('name', [
    'process_00001.' + TAG[1:] + '.jckpt',            # a tag starts with s: never a layer number
    'process_00001.' + TAG.upper() + '.jckpt',
    'process_00001.' + TAG + '0.jckpt',                # 24 hex digits exactly
    'process_00001.' + TAG + '.1.jckpt',               # the layer comes first
    'process_00001.jckpt.' + TAG + '.jckpt',
    'process_0001.jckpt',                  # four digits
    'process_00001.0.jckpt',               # layer 0 is written without a number
    'process_00001.01.jckpt',              # no leading zero in a layer
    'process_00001.-1.jckpt',
    'process_00001.jckpt\n',
    'process_00001.jckpt' + STAGE_TAG + '0000abcd.00000001.0123456789abcdef',
    'process_00001.jckpt' + LEASE_SUFFIX,
    'process_' + '\u0661' * 5 + '.jckpt',  # non-ASCII digits
    'xprocess_00001.jckpt',
    INDEX_NAME,
    step_name(1),
])
def test_what_is_not_a_piece(name):
    assert PIECE_RE.match(name) is None


# --- tags and keys ----------------------------------------------------------------------------------

def test_tags_are_distinct_and_none_is_a_prefix_of_another():
    tags = [STAGE_TAG, STAGE_DIR_TAG, NEXT_TAG, LEASE_SUFFIX]
    assert len(set(tags)) == len(tags)
    for a in tags:
        for b in tags:
            assert a == b or not b.startswith(a), (a, b)


def test_every_known_key_is_reserved_and_named():
    assert set(KNOWN_KEYS) == {names.STEP_KEY, names.METRICS_KEY, names.TRAINER_STATE_KEY,
                               names.LINEAGE_KEY, names.GENERATION_KEY, names.EMPTY_NODES_KEY,
                               names.ORBAX_JSON_KEY, names.SAVE_KEY}
    assert all(k.startswith(RESERVED_PREFIX) for k in KNOWN_KEYS)
    assert len(set(KNOWN_KEYS.values())) == len(KNOWN_KEYS)


def test_the_files_of_a_directory_are_no_steps_and_no_pieces():
    for name in (INDEX_NAME, names.DIRECTORY_LOCK_NAME):
        assert STEP_RE.match(name) is None and PIECE_RE.match(name) is None
    assert isinstance(names.LAYOUT_VERSION, int) and names.LAYOUT_VERSION >= 1


@pytest.mark.parametrize('directory, names, expected', [
    ('run/step_00000002.jckpt', ['model.npz', 'trainer_state.json'], True),
    ('run/step_00000002.jckpt/', ['trainer_state.json'], True),
    ('step_00000002.jckpt', ['model.npz'], False),                         # no record: unfinished
    ('out/checkpoint-500', ['model.safetensors', 'trainer_state.json'], False),  # Hugging Face's
])
def test_is_format_step(directory, names, expected):
    from jckpt.format.names import is_format_step
    assert is_format_step(directory, names) is expected
