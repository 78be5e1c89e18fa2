"""Header summaries (jckpt.tools.summary): a file's entries, a directory checkpoint's arrays and pieces."""

import json
import os

import jax
import numpy as np
import pytest

import jckpt
from jckpt.adapters import native
from jckpt.format import Entry
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, METRICS_KEY, STEP_KEY, TRAINER_STATE_KEY
from jckpt.tools.summary import (
    DirectoryInfo,
    EntryInfo,
    FileInfo,
    PieceFileInfo,
    directory_info,
    file_info,
    known_metadata,
    tree_size,
)
from tests.helpers import entry_text, header_text, raw_file, write_arrays, write_directory

# --- a file ------------------------------------------------------------------------------------

def test_a_file_and_a_directory_describe_one_array_alike(tmp_path):
    """Both summaries take an entry's identity, dtype and size from one place: the same
    array saved as a file and as a directory is listed with the same facts."""
    arrays = {'a/w': np.arange(8.0, dtype=np.float32).reshape(4, 2), 'n': np.arange(4, dtype=np.int8)}
    f = file_info(write_arrays(tmp_path / 'm.jckpt', arrays))
    d = directory_info(write_directory(tmp_path / 'ckpt', arrays))
    common = ('namespace', 'path', 'id', 'prec', 'dtype', 'shape', 'nbytes', 'name')
    assert [[getattr(e, k) for k in common] for e in f.entries] == \
        [[getattr(a, k) for k in common] for a in d.entries]
    assert [r.split()[2] for r in f.render().splitlines() if r.startswith('jckpt ')] == \
        [r.split()[2] for r in d.render().splitlines() if r.startswith('jckpt ')]

def test_file_info(tmp_path):
    path = write_arrays(tmp_path / 'm.jckpt', {'params/w': np.ones((784, 512), np.float32),
                                               'step': np.int32(3)},
                        metadata={'jckpt.trainer_state': '{"global_step": 3}', 'owner': '<b>me</b>'})
    s = file_info(path)
    assert isinstance(s, FileInfo) and s.kind == 'file'
    assert s.size == os.path.getsize(path) and s.alignment == 32 and s.writer == 'jckpt test'
    assert [e.name for e in s.entries] == ['jckpt/params/w', 'jckpt/step']
    w = s.entry('jckpt/params/w')
    assert (w.shape, w.dtype, w.nbytes, w.offset, w.mappable) == ((784, 512), 'float32', 1605632, 0, True)
    assert s.payload_bytes == 1605632 + 4 and s.namespaces == {'jckpt': 2}

    text = repr(s)
    assert 'params/w' in text and '(784, 512)' in text and '1.5 MiB' in text
    assert 'trainer state: {"global_step": 3}' in text
    assert 'total: 2 entries' in text

    page = s._repr_html_()
    assert page.count('<table>') == 2 and '<td style="text-align:left">params/w</td>' in page
    assert '<b>me</b>' not in page and '&lt;b&gt;me&lt;/b&gt;' in page  # escaped

    data = json.loads(json.dumps(s.to_dict()))
    assert data['trainer_state'] == {'global_step': 3} and data['metadata']['owner'] == '<b>me</b>'
    assert data['entries'][0]['shape'] == [784, 512]


def test_file_info_repr_is_bounded(tmp_path):
    path = write_arrays(tmp_path / 'many.jckpt',
                        {f'w{i:03d}': np.zeros(1, np.float32) for i in range(100)})
    s = file_info(path)
    assert '... 60 more entries' in repr(s) and 'w099' not in repr(s)
    assert 'w099' in s.render()
    assert '... 60 more entries' in s._repr_html_()
    short = s.render(limit=3)
    assert sum(line.startswith('jckpt ') for line in short.split('\n')) == 3
    assert '... 97 more entries' in short


def test_padded_and_unmapped_entries(tmp_path):
    # An OCANNL-style padded entry (written by hand): only the interior is stored; never mapped.
    text = header_text(entry_text(prec='Single_prec', dims='(4)', length=8,
                                  padding='(((1 1)) 0.)'))
    path = tmp_path / 'pad.ckpt'
    path.write_bytes(raw_file(text, np.ones(2, np.float32).tobytes(), align=4))
    s = file_info(path)
    e = s.entries[0]
    assert e.padded and not e.mappable and e.shape == (4,) and e.nbytes == 8
    assert e.path == 'n0' and e.name == 'jckpt/n0' and e.checksum is None  # no path, no checksum
    assert 'no (padded)' in repr(s) and s.mappable == 0 and 'writer: (not recorded)' in repr(s)


def test_a_misaligned_payload_is_not_mappable(tmp_path):
    path = tmp_path / 'odd.ckpt'  # a float32 payload at an odd offset, written by hand
    text = header_text(entry_text(prec='Single_prec', dims='(1)', offset=1, length=4))
    path.write_bytes(raw_file(text, b'\0' + np.ones(1, np.float32).tobytes(), align=4))
    s = file_info(path)
    assert not s.entries[0].mappable and not s.entries[0].padded
    assert s.mappable == 0 and '0 of 1 mappable' in repr(s)
    assert s.render().split('\n')[-2].endswith('  no')


def test_pieces_and_keys_show_what_they_are(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(8.0).reshape(4, 2)})
    s = file_info(os.path.join(d, 'process_00001.jckpt'))
    e = s.entries[0]
    assert (e.slice, e.global_dims, e.shape) == (((2, 4), (0, 2)), (4, 2), (2, 2))
    assert '(2, 2) of (4, 2)' in repr(s)
    assert e.to_dict()['slice'] == [[2, 4], [0, 2]] and e.to_dict()['global_dims'] == [4, 2]

    key = tmp_path / 'key.jckpt'
    jckpt.save(jckpt.Context(), {'k': jax.random.key(0)}, key)
    k = file_info(key).entries[0]
    assert k.key_impl == 'threefry2x32' and k.dtype == 'uint32'
    assert 'key<threefry2x32>' in repr(file_info(key))
    assert k.checksum is not None and k.checksum.startswith('xxh3_64:')


def test_a_file_without_entries(tmp_path):
    path = write_arrays(tmp_path / 'empty.jckpt', {})
    s = file_info(path)
    assert s.entries == () and s.payload_bytes == 0 and s.namespaces == {} and s.mappable == 0
    assert '(no entries)' in repr(s) and '0 entries in 0 namespaces' in repr(s)


def test_entry_lookup_by_name(tmp_path):
    s = file_info(write_arrays(tmp_path / 'a.jckpt', {'w': np.ones(1)}, namespace='model'))
    assert s.entry('model/w').namespace == 'model'
    with pytest.raises(KeyError):
        s.entry('jckpt/w')


def test_namespaces_count_in_first_appearance_order(tmp_path):
    path = str(tmp_path / 'ns.jckpt')
    native.write({'zeta': {'a': np.ones(1), 'b': np.ones(1)}, 'alpha': {'a': np.ones(1)}}, path)
    assert list(file_info(path).namespaces.items()) == [('zeta', 2), ('alpha', 1)]


def test_a_directory_missing_a_piece_is_said_so_by_inspect_and_convert(tmp_path):
    """`jckpt inspect` and `convert` of a directory whose index names a piece that is gone
    said "no such checkpoint file ... save a checkpoint there first", of the piece."""
    from jckpt.api.multiprocess import save_directory

    directory = tmp_path / "d"
    save_directory(jckpt.Context(), {"w": np.ones(4)}, directory)
    (directory / "process_00000.jckpt").unlink()
    for call in (jckpt.info, lambda p: jckpt.convert(p, tmp_path / "whole.jckpt"),
                 lambda p: jckpt.diff(p, p)):
        with pytest.raises(jckpt.FormatError, match="which the index names, is missing") as e:
            call(directory)
        assert "complete copy" in e.value.fix
    assert not (tmp_path / "whole.jckpt").exists()


def test_file_info_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(jckpt.FormatError) as info:
        file_info(tmp_path / 'missing.jckpt')
    assert info.value.file == str(tmp_path / 'missing.jckpt')
    (tmp_path / 'junk').write_bytes(b'\x00\x00\x00\x05((((')
    with pytest.raises(jckpt.FormatError):
        file_info(tmp_path / 'junk')


def test_entry_info_of_an_entry():
    e = Entry(id=3, namespace='m', prec='Single_prec', dims=(2,), offset=64, byte_length=8,
              path=(('k', 'a'), ('i', 0)), checksum=('xxh3_64', 'ab' * 8))
    info = EntryInfo.from_entry(e, data_start=128)
    assert (info.name, info.id, info.offset, info.mappable) == ('m/a/0', 3, 64, True)
    assert info.checksum == 'xxh3_64:' + 'ab' * 8 and info.slice is None
    assert not EntryInfo.from_entry(e, data_start=130).mappable
    assert json.loads(json.dumps(info.to_dict()))['shape'] == [2]


# --- known metadata ----------------------------------------------------------------------------

def test_known_metadata_decodes_what_it_can():
    meta = {STEP_KEY: '100', GENERATION_KEY: '7', METRICS_KEY: '{"loss": 0.5}',
            TRAINER_STATE_KEY: '{"global_step": 100}', LINEAGE_KEY: 'run', 'note': 'x'}
    assert known_metadata(meta) == {'step': 100, 'generation': 7, 'metrics': {'loss': 0.5},
                                    'trainer_state': {'global_step': 100}, 'lineage': 'run'}
    assert known_metadata({'note': 'x'}) == {}


def test_known_metadata_keeps_an_unreadable_value_as_text():
    meta = {STEP_KEY: 'ten', GENERATION_KEY: '', METRICS_KEY: '{bad', TRAINER_STATE_KEY: 'x'}
    assert known_metadata(meta) == {'step': 'ten', 'generation': '', 'metrics': '{bad',
                                    'trainer_state': 'x'}


# --- a directory checkpoint --------------------------------------------------------------------

def test_directory_info(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(24, dtype=np.float32).reshape(6, 4),
                                            'b': np.arange(4, dtype=np.int16)},
                        processes=2, metadata={'jckpt.step': '9', 'note': '<x>'})
    s = directory_info(d)
    assert isinstance(s, DirectoryInfo) and s.kind == 'directory' and s.entries is s.arrays
    assert [(a.name, a.shape, a.dtype, a.pieces, a.files) for a in s.arrays] == [
        ('jckpt/w', (6, 4), 'float32', 2, ('process_00000.jckpt', 'process_00001.jckpt')),
        ('jckpt/b', (4,), 'int16', 2, ('process_00000.jckpt', 'process_00001.jckpt'))]
    assert all(a.mappable for a in s.arrays)
    assert s.payload_bytes == 96 + 8 and s.namespaces == {'jckpt': 2}
    names = sorted(os.listdir(d))
    assert s.size == sum(os.path.getsize(os.path.join(d, n)) for n in names) == tree_size(d)
    assert [f.name for f in s.files] == ['process_00000.jckpt', 'process_00001.jckpt']
    first = s.files[0]
    assert isinstance(first, PieceFileInfo) and first.entries == 2
    assert first.size == os.path.getsize(os.path.join(d, first.name))
    assert sum(f.payload_bytes for f in s.files) == s.payload_bytes

    text = repr(s)
    assert text.startswith(f'{d}: multi-process checkpoint directory, 2 arrays in 1 namespace')
    assert 'in 2 piece files' in text and 'step: 9' in text and 'total: 2 arrays' in text
    assert '<x>' not in s._repr_html_() and '&lt;x&gt;' in s._repr_html_()
    data = json.loads(json.dumps(s.to_dict()))
    assert data['kind'] == 'directory' and data['step'] == 9 and data['metadata']['note'] == '<x>'
    assert data['totals'] == {'arrays': 2, 'payload_bytes': 104, 'namespaces': {'jckpt': 2}}
    assert data['arrays'][0]['files'] == ['process_00000.jckpt', 'process_00001.jckpt']


def test_directory_info_repr_is_bounded(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {f'a{i:02d}': np.zeros(2) for i in range(45)})
    s = directory_info(d)
    assert '... 5 more arrays' in repr(s) and 'a44' in s.render()


def test_directory_info_refuses_a_directory_without_index(tmp_path):
    with pytest.raises(jckpt.FormatError, match='no index.jckpt'):
        directory_info(tmp_path)


def test_tree_size_counts_files_below_and_links_as_links(tmp_path):
    (tmp_path / 'a').write_bytes(b'x' * 10)
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'b').write_bytes(b'y' * 1000)
    os.symlink(tmp_path / 'sub' / 'b', tmp_path / 'link')
    assert tree_size(str(tmp_path)) == 10 + 1000 + os.lstat(tmp_path / 'link').st_size
    assert tree_size(str(tmp_path / 'missing')) == 0


KEYS = {'k': jax.random.key(0), 'ks': jax.random.split(jax.random.key(1), 3),
        'r': jax.random.key(2, impl='rbg')}


def test_a_typed_key_shows_the_key_arrays_shape_not_its_datas(tmp_path):
    """A scalar threefry key was listed as `key<threefry2x32> (2,)`: its key data's shape."""
    path = tmp_path / 'keys.jckpt'
    jckpt.save(jckpt.Context(), KEYS, path)
    s = file_info(path)
    got = {e.path: (e.key_impl, e.shape) for e in s.entries}
    assert got == {'k': ('threefry2x32', ()), 'ks': ('threefry2x32', (3,)), 'r': ('rbg', ())}
    assert {p: e.shape for p, e in KEYS.items()} == {p: shape for p, (_, shape) in got.items()}
    rows = {line.split()[1]: line.split()[2:4] for line in repr(s).splitlines()
            if line.startswith('jckpt ')}
    assert rows == {'k': ['key<threefry2x32>', '()'], 'ks': ['key<threefry2x32>', '(3,)'],
                    'r': ['key<rbg>', '()']}
    data = json.loads(json.dumps(s.to_dict()))
    assert [(e['path'], e['shape'], e['key_impl']) for e in data['entries']] == [
        ('k', [], 'threefry2x32'), ('ks', [3], 'threefry2x32'), ('r', [], 'rbg')]


def test_a_typed_key_in_a_directory_checkpoint_shows_the_key_arrays_shape(tmp_path):
    with jckpt.CheckpointManager(tmp_path / 'run', directory_steps=True) as mgr:
        mgr.save(1, KEYS)
    step = tmp_path / 'run' / 'step_00000001.jckpt'
    s = jckpt.info(step)
    assert isinstance(s, DirectoryInfo)
    assert {a.path: (a.key_impl, a.shape) for a in s.arrays} == {
        'k': ('threefry2x32', ()), 'ks': ('threefry2x32', (3,)), 'r': ('rbg', ())}
    assert [a['shape'] for a in json.loads(json.dumps(s.to_dict()))['arrays']] == [[], [3], []]
    piece = {e.path: e for e in file_info(os.path.join(step, s.files[0].name)).entries}['ks']
    assert (piece.shape, piece.global_dims, piece.slice) == ((3,), (3,), ((0, 3),))
