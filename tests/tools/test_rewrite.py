"""Rewriting files without decoding them (jckpt.tools.rewrite): relayout and merge, bytes kept verbatim."""

import os

import numpy as np
import pytest

import jckpt
import jckpt.adapters
from jckpt.errors import ChecksumError, ClashError, FormatError, InputError
from jckpt.storage import CheckpointReader
from jckpt.tools.info import info
from jckpt.tools.rewrite import merge, relayout
from jckpt.tools.verify import verify
from jckpt.version import __version__
from tests.helpers import corrupt_payload, entry_text, header_text, raw_file, write_arrays


def load(path):
    return jckpt.load(jckpt.Context(host=True), path)[1]


def ocannl(path, *ids):
    """A file of path-less (OCANNL) float32 entries with these ids, written by hand."""
    entries = [entry_text(id=i, offset=4 * n) for n, i in enumerate(ids)]
    path.write_bytes(raw_file(header_text(*entries), np.ones(len(ids), np.float32).tobytes(), align=4))
    return path


# --- relayout ----------------------------------------------------------------------------------

def test_relayout_in_place(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(10.0)}, alignment=1)
    before = info(a).entries[0].checksum
    relayout(a, a, alignment=512, durable=False)
    s = info(a)
    assert s.alignment == 512 and s.data_start % 512 == 0 and s.entries[0].checksum == before
    assert verify(a).ok


def test_relayout_keeps_entries_metadata_and_bytes(tmp_path):
    src = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(10.0), 'y/z': np.arange(3, dtype=np.int8)},
                       alignment=8, metadata={'note': 'kept', 'jckpt.step': '4'})
    dst = tmp_path / 'b.jckpt'
    header = relayout(src, dst, durable=False)
    old, new = CheckpointReader(src), CheckpointReader(dst)
    assert header.alignment == 8 == new.header.alignment  # default: the source's alignment
    assert header.writer == f'jckpt {__version__}'
    assert new.header.metadata == old.header.metadata
    assert [(e.name, e.id, e.prec, e.dims, e.checksum) for e in new.header.tensors] == \
        [(e.name, e.id, e.prec, e.dims, e.checksum) for e in old.header.tensors]
    for e_old, e_new in zip(old.header.tensors, new.header.tensors):
        assert bytes(new.payload_bytes(e_new)) == bytes(old.payload_bytes(e_old))
        assert (new.data_start + e_new.offset) % 8 == 0
    assert new.verify() == []


def test_relayout_gives_the_canonical_layout(tmp_path):
    text = header_text(entry_text(id=0, offset=8, length=4))
    src = tmp_path / 'loose.ckpt'
    src.write_bytes(raw_file(text, b'\xff' * 8 + np.ones(1, np.float32).tobytes() + b'tail', align=4))
    assert verify(src).warnings  # a gap that is not zero-filled and bytes after the last payload
    relayout(src, tmp_path / 'tight.jckpt', durable=False)
    r = verify(tmp_path / 'tight.jckpt')
    assert r.problems == () and r.checked == 1  # and a checksum where the source had none
    np.testing.assert_array_equal(load(tmp_path / 'tight.jckpt')['jckpt']['n0'], np.ones(1))


def test_relayout_refuses_to_replace_another_file(tmp_path):
    src = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(3.0)})
    other = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(1)})
    with pytest.raises(InputError, match='would replace an existing checkpoint') as e:
        relayout(src, other, durable=False)
    assert e.value.file == other
    assert [x.name for x in info(other).entries] == ['jckpt/y']  # untouched
    relayout(src, other, overwrite=True, durable=False)
    assert [x.name for x in info(other).entries] == ['jckpt/x']


@pytest.mark.parametrize('alignment', [0, -32, 1.5, '64'])
def test_relayout_refuses_a_bad_alignment(tmp_path, alignment):
    src = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(3.0)})
    with pytest.raises(InputError, match='alignment must be a power of two'):
        relayout(src, tmp_path / 'b.jckpt', alignment=alignment)
    assert not (tmp_path / 'b.jckpt').exists()


def test_relayout_refuses_a_corrupt_source_unless_told(tmp_path):
    src = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(3.0), 'y': np.ones(2), 'z': np.ones(2)})
    corrupt_payload(src, 'jckpt/y')
    corrupt_payload(src, 'jckpt/z')
    dst = tmp_path / 'b.jckpt'
    with pytest.raises(ChecksumError, match=r'\(and 1 more entries\); refusing to copy') as e:
        relayout(src, dst, durable=False)
    assert (e.value.file, e.value.entry) == (src, 'jckpt/y') and 'verify=False' in e.value.fix
    assert not dst.exists()
    relayout(src, dst, verify=False, durable=False)  # copied as it is: still caught later
    assert [p.entry for p in verify(dst).errors] == ['jckpt/y', 'jckpt/z']


def test_relayout_of_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FormatError, match='no such checkpoint file'):
        relayout(tmp_path / 'missing.jckpt', tmp_path / 'b.jckpt')


def test_a_multi_process_checkpoint_or_one_of_its_pieces_is_refused_saying_how(tmp_path):
    """A piece holds one process's slices: rewritten alone it became a partial model."""
    from tests.helpers import write_directory
    d = write_directory(tmp_path / 'sharded', {'jckpt/w': np.arange(8.0).reshape(4, 2)})
    piece = os.path.join(d, sorted(n for n in os.listdir(d) if n.startswith('process_'))[1])
    whole = write_arrays(tmp_path / 'whole.jckpt', {'v': np.ones(2)})
    for source, what in ((d, "multi-process checkpoint's directory"), (piece, 'a piece file')):
        for rewrite in (lambda s: relayout(s, tmp_path / 'r.jckpt'),
                        lambda s: merge(tmp_path / 'm.jckpt', [whole, s], prefixes=['a', 'b'])):
            with pytest.raises(FormatError, match=what) as e:
                rewrite(source)
            assert f'jckpt convert {d} whole.jckpt' in e.value.fix
    assert not (tmp_path / 'r.jckpt').exists() and not (tmp_path / 'm.jckpt').exists()


# --- merge -------------------------------------------------------------------------------------

def test_merge_renumbers_ids_and_keeps_bytes(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(3.0)}, metadata={'k': 'a'})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.arange(5, dtype=np.int16)},
                     metadata={'k': 'b', 'm': '1'})
    out = tmp_path / 'out.jckpt'
    header = merge(out, [a, b], durable=False)  # same namespace, distinct paths: no prefix needed
    assert [(e.namespace, e.id) for e in header.tensors] == [('jckpt', 0), ('jckpt', 1)]
    assert dict(header.metadata) == {'k': 'a', 'm': '1'}
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    np.testing.assert_array_equal(tree['jckpt']['x'], np.arange(3.0))
    np.testing.assert_array_equal(tree['jckpt']['y'], np.arange(5, dtype=np.int16))
    with pytest.raises(jckpt.ClashError, match='also present'):
        merge(tmp_path / 'o2.jckpt', [a, a], durable=False)
    with pytest.raises(jckpt.InputError, match='existing checkpoint'):
        merge(out, [a], durable=False)


def test_merge_matches_load_with_prefix(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'p/w': np.ones(2, np.float32)})
    out = tmp_path / 'out.jckpt'
    merge(out, [a, a], ['teacher', 'student'], durable=False)
    ctx, t1 = jckpt.load(jckpt.Context(host=True), a, prefix_namespace='teacher')
    ctx, t2 = jckpt.load(ctx, a, prefix_namespace='student')
    _, merged = jckpt.load(jckpt.Context(host=True), out)
    assert sorted(merged) == sorted({**t1, **t2}) == ['student__jckpt', 'teacher__jckpt']


def test_merge_keeps_every_inputs_empty_nodes_in_its_renamed_namespace(tmp_path):
    """An optax `EmptyState` (here `()`) of each input survives a merge, in the namespace its
    entries went to, so that reading the merged file (an orbax export) rebuilds it."""
    ctx = jckpt.Context(durable=False)
    a, b, out = tmp_path / 'a.jckpt', tmp_path / 'b.jckpt', tmp_path / 'out.jckpt'
    jckpt.save(ctx, {'w': np.ones(2, np.float32), 'opt': ()}, a)
    jckpt.save(ctx, {'w': np.zeros(2, np.float32), 'ema': None}, b)
    merge(out, [a, b], ['teacher', 'student'], durable=False)
    read = jckpt.adapters.read(out)
    assert sorted(read) == ['student__jckpt', 'teacher__jckpt']
    assert read['teacher__jckpt']['opt'] is None and read['student__jckpt']['ema'] is None


def test_merge_keeps_the_ids_of_path_less_entries(tmp_path):
    """An OCANNL entry is named by its id (n<id>): merging renumbers the others around it."""
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.ones(2, np.float32), 'y': np.ones(2, np.float32)})
    header = merge(tmp_path / 'm.jckpt', [a, ocannl(tmp_path / 'o.ckpt', 1)], durable=False)
    assert [(e.name, e.id) for e in header.tensors] == [('jckpt/x', 0), ('jckpt/y', 2),
                                                        ('jckpt/n1', 1)]
    assert verify(tmp_path / 'm.jckpt').ok


def test_merge_id_plan_renumbers_above_every_input(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.ones(1), 'y': np.ones(1)})      # ids 0, 1
    b = write_arrays(tmp_path / 'b.jckpt', {'z': np.ones(1), 'w': np.ones(1)})      # ids 0, 1
    c = write_arrays(tmp_path / 'c.jckpt', {'v': np.ones(1)}, namespace='other')    # id 0
    o = ocannl(tmp_path / 'o.ckpt', 5, 0)
    header = merge(tmp_path / 'm.jckpt', [a, b, c, o], durable=False)
    assert [(e.name, e.id) for e in header.tensors] == [
        ('jckpt/x', 6), ('jckpt/y', 1), ('jckpt/z', 7), ('jckpt/w', 8),   # 0 is the OCANNL's
        ('other/v', 0), ('jckpt/n5', 5), ('jckpt/n0', 0)]
    assert len({(e.namespace, e.id) for e in header.tensors}) == 7
    tree = load(tmp_path / 'm.jckpt')['jckpt']
    assert sorted(tree) == ['n0', 'n5', 'w', 'x', 'y', 'z']


def test_merge_clashes_name_both_files(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.ones(1), 'y': np.ones(1)})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.zeros(1)})
    out = tmp_path / 'm.jckpt'
    with pytest.raises(ClashError, match=f'also present in {a}') as e:
        merge(out, [a, b], durable=False)
    assert (e.value.file, e.value.entry) == (b, 'jckpt/y') and '--prefix' in e.value.fix
    assert not out.exists()
    with pytest.raises(ClashError, match='also present'):  # path-less entries clash by id
        merge(out, [ocannl(tmp_path / 'o1.ckpt', 3), ocannl(tmp_path / 'o2.ckpt', 3)],
              durable=False)
    merge(out, [a, b], ['', 'b'], durable=False)  # an empty prefix leaves its input alone
    assert sorted(load(out)) == ['b__jckpt', 'jckpt']


@pytest.mark.parametrize('first, second', [
    (np.float32(1), {'w': np.ones(2)}),            # a root leaf, and a leaf below the root
    ({'x': np.ones(1)}, {'x': {'y': np.ones(2)}}),  # a leaf where the other holds a node
    ({1: np.ones(1)}, {'w': np.ones(2)}),          # integer keys beside string keys
], ids=['root', 'leaf-node', 'mixed-keys'])
def test_merge_refuses_inputs_that_would_not_form_one_tree(tmp_path, first, second):
    """The merged file was written, and no load could rebuild its namespace."""
    a, b, out = tmp_path / 'a.jckpt', tmp_path / 'b.jckpt', tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), first, a)
    jckpt.save(jckpt.Context(), second, b)
    with pytest.raises(InputError, match="namespace 'jckpt' would not form one tree") as e:
        merge(out, [a, b], durable=False)
    assert e.value.file == str(out) and 'prefix' in e.value.fix and not out.exists()
    merge(out, [a, b], ['', 'b'], durable=False)
    assert sorted(load(out)) == ['b__jckpt', 'jckpt']


def test_merge_appends_to_an_existing_file(tmp_path):
    out = write_arrays(tmp_path / 'm.jckpt', {'x': np.arange(2.0)}, metadata={'k': 'out'})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.arange(3.0)}, metadata={'k': 'b', 'n': '1'})
    header = merge(out, [b], append=True, durable=False)
    assert [(e.name, e.id) for e in header.tensors] == [('jckpt/x', 0), ('jckpt/y', 1)]
    assert dict(header.metadata) == {'k': 'out', 'n': '1'}
    tree = load(out)['jckpt']
    np.testing.assert_array_equal(tree['x'], np.arange(2.0))
    np.testing.assert_array_equal(tree['y'], np.arange(3.0))
    new = tmp_path / 'new.jckpt'
    merge(new, [b], append=True, durable=False)  # nothing to append to: a plain merge
    assert [e.name for e in info(new).entries] == ['jckpt/y']


def test_merge_onto_an_existing_file_names_the_options_that_allow_it(tmp_path):
    """The fix said "allow overwriting it", naming no option (and not --append)."""
    out = write_arrays(tmp_path / 'm.jckpt', {'old': np.ones(1)})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(1)})
    with pytest.raises(InputError, match='would replace an existing checkpoint') as e:
        merge(out, [b], durable=False)
    assert '--append' in e.value.fix and '--overwrite' in e.value.fix
    assert 'overwrite=True' in e.value.fix and 'append=True' in e.value.fix
    with pytest.raises(InputError) as e:
        relayout(b, out, durable=False)
    assert 'overwrite=True (--overwrite)' in e.value.fix


def test_merge_overwrite_replaces_an_existing_file(tmp_path):
    out = write_arrays(tmp_path / 'm.jckpt', {'old': np.ones(1)})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(1)})
    merge(out, [b], overwrite=True, durable=False)
    assert [e.name for e in info(out).entries] == ['jckpt/y']


def test_merge_alignment(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(3.0)}, alignment=1)
    assert merge(tmp_path / 'd.jckpt', [a], durable=False).alignment == 32  # the writer's default
    assert merge(tmp_path / 'e.jckpt', [a], alignment=4096, durable=False).alignment == 4096
    assert CheckpointReader(tmp_path / 'e.jckpt').data_start % 4096 == 0


@pytest.mark.parametrize('args,kwargs,match', [
    ([[]], {}, 'nothing to merge: no input files given'),
    ([['A'], ['p', 'q']], {}, '2 prefixes for 1 inputs'),
    ([['A'], ['not-valid']], {}, "invalid namespace prefix 'not-valid'"),
    ([['A']], {'alignment': 0}, 'alignment must be a power of two'),
])
def test_merge_refuses_bad_arguments_before_writing(tmp_path, args, kwargs, match):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.ones(1)})
    args = [[a if p == 'A' else p for p in args[0]], *args[1:]]
    with pytest.raises(InputError, match=match):
        merge(tmp_path / 'out.jckpt', *args, durable=False, **kwargs)
    assert not (tmp_path / 'out.jckpt').exists()


def test_merge_refuses_a_corrupt_input(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.ones(4)})
    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(4)})
    corrupt_payload(b, 'jckpt/y')
    with pytest.raises(ChecksumError, match='refusing to copy a corrupt payload') as e:
        merge(tmp_path / 'out.jckpt', [a, b], durable=False)
    assert (e.value.file, e.value.entry) == (b, 'jckpt/y')
    assert sorted(os.listdir(tmp_path)) == ['a.jckpt', 'b.jckpt']  # nothing written, nothing left
    merge(tmp_path / 'out.jckpt', [a, b], verify=False, durable=False)
    assert [p.entry for p in verify(tmp_path / 'out.jckpt').errors] == ['jckpt/y']


def test_merge_names_a_foreign_file_or_a_manager_as_inspect_does(tmp_path):
    """A safetensors input was read as a jckpt header ("header length 2415919104 extends past
    the end of the file"); a manager's directory was "a directory, not a checkpoint file"."""
    a = tmp_path / 'a.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(2)}, a)
    jckpt.adapters.write({'jckpt': {'v': np.ones(2)}}, tmp_path / 'b.safetensors')
    with jckpt.CheckpointManager(tmp_path / 'run') as mgr:
        mgr.save(1, {'w': np.ones(2)})
    for other, match, fix in (('b.safetensors', 'in safetensors format', 'jckpt convert'),
                              ('run', "checkpoint manager's directory", 'step_NNNNNNNN.jckpt')):
        with pytest.raises(FormatError, match=match) as e:
            merge(tmp_path / 'out.jckpt', [a, tmp_path / other])
        assert fix in e.value.fix
    assert not (tmp_path / 'out.jckpt').exists()


def test_merge_reads_a_checkpoint_a_killed_save_set_aside(tmp_path, monkeypatch):
    """Where readers find it, so does merge (it opened the missing path instead)."""
    from jckpt.storage import directory as dr
    path = tmp_path / 'ckpt'
    jckpt.save(jckpt.Context(), {'w': np.arange(3.0)}, path)
    os.rename(path, f"{path}{dr.OLD_DIR_TAG}{'c' * 16}")
    merge(tmp_path / 'out.jckpt', [path], prefixes=['a'])
    assert load(tmp_path / 'out.jckpt')['a__jckpt']['w'][2] == 2


@pytest.mark.parametrize('rewrite', ['relayout', 'merge'])
def test_a_source_replaced_after_it_was_read_is_not_copied_from(tmp_path, monkeypatch, rewrite):
    """relayout and merge copied the payloads of whatever file held the path by then, under
    the header of the file they had read (an appending save refused it already)."""
    from jckpt.tools import rewrite as rewrite_mod
    src = tmp_path / 'a.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.arange(64.0)}, src)
    other = tmp_path / 'other.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.zeros(64)}, other)
    real = rewrite_mod._check_sources

    def replaced_meanwhile(reader):
        real(reader)
        os.replace(other, src)
    monkeypatch.setattr(rewrite_mod, '_check_sources', replaced_meanwhile)
    out = tmp_path / 'out.jckpt'
    with pytest.raises(jckpt.InUseError, match='the file was replaced since it was read') as e:
        relayout(src, out) if rewrite == 'relayout' else merge(out, [src])
    assert e.value.file == str(src) and not out.exists()


def test_merge_and_relayout_never_replace_what_is_not_a_checkpoint(tmp_path):
    """`merge(..., overwrite=True)` replaced a text file with the merged checkpoint, and onto a
    folder of other files, a manager's run or a directory checkpoint with a note beside it,
    merge and relayout copied every payload before failing to publish over the directory."""
    from jckpt.api import multiprocess

    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(1)})
    notes = tmp_path / 'notes.txt'
    notes.write_text('precious')
    folder = tmp_path / 'mine'
    folder.mkdir()
    (folder / 'a.txt').write_text('kept')
    with jckpt.CheckpointManager(tmp_path / 'run', asynchronous=False) as mgr:
        mgr.save(1, {'w': np.ones(2)})
    beside = tmp_path / 'dir.jckpt'
    multiprocess.save_directory(jckpt.Context(), {'w': np.ones(2)}, beside)
    (beside / 'notes.txt').write_text('precious')
    for dst, there in ((notes, 'a file that is not a checkpoint (8 bytes)'),
                       (folder, 'a directory holding 1 entry that is no part of a checkpoint (a.txt)'),
                       (tmp_path / 'run', 'no part of a checkpoint (step_00000001.jckpt)'),
                       (beside, 'no part of a checkpoint (notes.txt)')):
        for what, write in (('merging', lambda d: merge(d, [b], overwrite=True, durable=False)),
                            ('writing the re-laid-out file',
                             lambda d: relayout(b, d, overwrite=True, durable=False))):
            with pytest.raises(InputError, match=f'{what} would replace') as e:
                write(dst)
            assert there in e.value.message and e.value.file == str(dst)
            assert 'never deletes' in e.value.fix
    assert notes.read_text() == 'precious' and (folder / 'a.txt').read_text() == 'kept'
    assert (beside / 'notes.txt').read_text() == 'precious'
    assert jckpt.CheckpointManager(tmp_path / 'run', read_only=True).all_steps() == [1]


def test_merge_and_relayout_onto_a_directory_checkpoint_fail_before_writing(tmp_path, monkeypatch):
    """`overwrite=True` onto a directory checkpoint (or an empty folder) copied every payload
    into a staging file and then failed to publish: a file cannot replace a directory."""
    from jckpt.api import multiprocess
    from jckpt.storage import publish

    b = write_arrays(tmp_path / 'b.jckpt', {'y': np.ones(1)})
    ckpt = tmp_path / 'dir.jckpt'
    multiprocess.save_directory(jckpt.Context(), {'w': np.ones(2)}, ckpt)
    (tmp_path / 'empty').mkdir()
    created = []
    real = publish.StagingFile._create
    monkeypatch.setattr(publish.StagingFile, '_create', lambda s: created.append(s) or real(s))
    for dst in (ckpt, tmp_path / 'empty'):
        for write in (lambda d: merge(d, [b], overwrite=True, durable=False),
                      lambda d: relayout(b, d, overwrite=True, durable=False)):
            with pytest.raises(InputError, match='a checkpoint file cannot replace it'):
                write(dst)
    assert created == [] and sorted(os.listdir(ckpt)) == ['index.jckpt', 'process_00000.jckpt']
