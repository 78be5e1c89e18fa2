"""``jckpt.info``, ``jckpt.verify``, ``diff``, ``jckpt.tools.rewrite`` and progress bars in Python."""

import io
import json
import os

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.format import Entry, Header, lay_out, prec_of
from jckpt.storage import ArraySource, CheckpointReader, write_checkpoint
from jckpt.tools.diff import diff
from jckpt.tools.info import info
from jckpt.tools.manager_info import ManagerInfo
from jckpt.tools.render import human_bytes
from jckpt.tools.rewrite import merge, relayout
from jckpt.tools.summary import FileInfo
from jckpt.tools.verify import verify


def write(path, arrays, *, namespace='jckpt', alignment=32, metadata=None):
    entries, sources = [], []
    for i, (name, a) in enumerate(arrays.items()):
        a = np.asarray(a)
        entries.append(Entry(id=i, namespace=namespace, prec=prec_of(a.dtype), dims=a.shape,
                             offset=0, byte_length=a.nbytes, label=tuple(name.split('/')),
                             path=tuple(('k', p) for p in name.split('/'))))
        sources.append(ArraySource(a))
    header = lay_out(Header(tensors=tuple(entries), alignment=alignment, writer='jckpt test',
                            metadata=tuple((metadata or {}).items())))
    write_checkpoint(path, header, sources, durable=False)
    return str(path)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def on_terminal(monkeypatch):
    """Replace sys.stderr by an in-memory terminal, outside CI (call it in the test body:
    pytest's output capture would undo it if done by a fixture)."""
    monkeypatch.delenv('CI', raising=False)
    monkeypatch.setenv('TERM', 'xterm-256color')
    fake = FakeTerminal()
    monkeypatch.setattr('sys.stderr', fake)
    return fake


# --- info --------------------------------------------------------------------

def test_info_file(tmp_path):
    path = write(tmp_path / 'm.jckpt', {'params/w': np.ones((784, 512), np.float32),
                                        'step': np.int32(3)},
                 metadata={'jckpt.trainer_state': '{"global_step": 3}', 'owner': '<b>me</b>'})
    s = jckpt.info(path)
    assert isinstance(s, FileInfo)
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


def test_info_repr_is_bounded(tmp_path):
    path = write(tmp_path / 'many.jckpt', {f'w{i:03d}': np.zeros(1, np.float32) for i in range(100)})
    s = info(path)
    assert '... 60 more entries' in repr(s) and 'w099' not in repr(s)
    assert 'w099' in s.render()
    assert '... 60 more entries' in s._repr_html_()


def test_info_name_stays_the_function():
    import jckpt.tools.info  # importing the module must not shadow the function

    assert callable(jckpt.info) and jckpt.info is info
    assert 'info' in jckpt.__all__ and 'verify' in jckpt.__all__


def test_info_missing_and_corrupt(tmp_path):
    with pytest.raises(jckpt.FormatError, match='no such checkpoint file'):
        info(tmp_path / 'missing.jckpt')
    bad = tmp_path / 'bad.jckpt'
    bad.write_bytes(b'\x00\x00\x00\x05((((')
    with pytest.raises(jckpt.FormatError) as e:
        info(bad)
    assert e.value.file == str(bad)


def test_info_padded_and_unmapped_entries(tmp_path):
    # An OCANNL-style padded entry (written by hand): only the interior is stored; never mapped.
    from tests.helpers import entry_text, header_text, raw_file

    text = header_text(entry_text(prec='Single_prec', dims='(4)', length=8,
                                  padding='(((1 1)) 0.)'))
    path = tmp_path / 'pad.ckpt'
    path.write_bytes(raw_file(text, np.ones(2, np.float32).tobytes(), align=4))
    e = info(path).entries[0]
    assert e.padded and not e.mappable and e.shape == (4,) and e.nbytes == 8
    assert 'no (padded)' in repr(info(path))


def _step(directory, step, metrics, **meta):
    return write(os.path.join(directory, f'step_{step:08d}.jckpt'), {'w': np.zeros(2, np.float32)},
                 metadata={'jckpt.step': str(step), 'jckpt.metrics': json.dumps(metrics),
                           'jckpt.lineage': 'run1', 'jckpt.generation': str(step), **meta})


def test_info_manager_directory(tmp_path):
    for step, m in ((1, {'loss': 3.0, 'acc': 0.1}), (2, {'loss': 1.0, 'acc': 0.5}),
                    (3, {'loss': 1.0, 'acc': 0.4}), (4, {'acc': 0.9})):
        _step(tmp_path, step, m)
    s = info(tmp_path)
    assert isinstance(s, ManagerInfo)
    assert [x.step for x in s.steps] == [1, 2, 3, 4]
    assert s.latest == 4 and s.best_metric == 'loss'
    assert s.best == 3  # ties go to the later step, as the manager ranks them
    assert info(tmp_path, best_metric='acc', best_mode='max').best == 4
    assert s.metric_names == ['acc', 'loss']
    text = repr(s)
    assert 'lineage: run1' in text and 'best 3 by loss (min)' in text
    assert '<table>' in s._repr_html_()
    json.dumps(s.to_dict())
    with pytest.raises(jckpt.InputError):
        info(tmp_path, best_mode='median')


def test_info_on_a_real_manager_directory(tmp_path):
    with jckpt.CheckpointManager(tmp_path, asynchronous=False) as mgr:
        for step, loss in ((10, 0.5), (20, 0.2)):
            mgr.save(step, {'w': np.full(3, step, np.float32)}, metrics={'loss': loss},
                     trainer_state=jckpt.TrainerState(global_step=step))
    s = info(tmp_path)
    assert s.latest == 20 and s.best == 20
    assert [x.generation for x in s.steps] == [1, 2]
    assert s.steps[0].lineage == s.steps[1].lineage is not None
    step = info(s.steps[1].path)
    assert step.to_dict()['trainer_state']['global_step'] == 20
    assert step.to_dict()['metrics'] == {'loss': 0.2}


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 30)] == \
        ['0 B', '1023 B', '1.0 KiB', '1.5 KiB', '5.0 GiB']


# --- verify and diff in Python -------------------------------------------------

def test_verify_report(tmp_path):
    path = write(tmp_path / 'm.jckpt', {'a': np.arange(4.0), 'b': np.arange(3, dtype=np.int8)})
    assert jckpt.verify(path).ok
    reader = CheckpointReader(path)
    where = reader.data_start + reader.header.tensors[1].offset
    del reader
    with open(path, 'r+b') as f:
        f.seek(where)
        f.write(b'\x7f')
    r = verify(path)
    assert not r.ok and r.checked == 1 and [p.entry for p in r.errors] == ['jckpt/b']
    assert 'checksum mismatch' in r.errors[0].message
    with pytest.raises(jckpt.FormatError):
        verify(tmp_path / 'nope.jckpt')


def test_verify_unchecked_entries_are_warnings(tmp_path):
    from tests.helpers import entry_text, header_text, raw_file

    path = tmp_path / 'old.ckpt'
    path.write_bytes(raw_file(header_text(entry_text()), np.ones(1, np.float32).tobytes(), align=4))
    r = verify(path)
    assert r.ok and r.checked == 0 and r.unchecked == ('jckpt/n0',)
    assert any('no checksum' in p.message for p in r.warnings)


def test_diff_values(tmp_path):
    a = write(tmp_path / 'a.jckpt', {
        'f': np.array([0.0, 1.0, np.nan, 4.0], np.float32),
        'big': np.array([2**60, 5], np.int64),
        'bf': np.array([1.0, 2.0], ml_dtypes.bfloat16),
        'flag': np.array([True, False]),
        'z': np.array([1 + 1j], np.complex64)})
    b = write(tmp_path / 'b.jckpt', {
        'f': np.array([0.0, 1.5, np.nan, 2.0], np.float32),
        'big': np.array([2**60 + 1, 5], np.int64),   # not exact in float64, still caught
        'bf': np.array([1.0, 2.0], ml_dtypes.bfloat16),
        'flag': np.array([True, True]),
        'z': np.array([1 + 2j], np.complex64)})
    r = diff(a, b)
    by = {d.name: d for d in r.entries}
    f = by['jckpt/f']
    assert (f.mismatched, f.max_abs, f.max_rel) == (2, 2.0, 1.0)  # NaN == NaN in place
    assert by['jckpt/big'].mismatched == 1 and not by['jckpt/big'].same
    assert by['jckpt/bf'].same and by['jckpt/bf'].max_abs == 0
    assert by['jckpt/flag'].mismatched == 1 and by['jckpt/flag'].max_rel == 1.0
    assert by['jckpt/z'].max_abs == 1.0
    assert by['jckpt/big'].max_abs == 1.0  # the exact integer difference
    assert not r.same
    assert diff(a, b, atol=2.0).same  # every difference is at most 2
    r = diff(a, b, atol=1.5)
    assert {d.name for d in r.differing} == {'jckpt/f'}
    json.dumps(r.to_dict())


def test_diff_nan_against_number(tmp_path):
    a = write(tmp_path / 'a.jckpt', {'x': np.array([np.nan, 1.0])})
    b = write(tmp_path / 'b.jckpt', {'x': np.array([0.0, 1.0])})
    d = diff(a, b, atol=1e9).entries[0]
    assert d.mismatched == 1 and d.max_abs == float('inf')
    assert 'inf' in json.dumps(diff(a, b).to_dict())


def test_diff_is_chunked(tmp_path, monkeypatch):
    import jckpt.tools.diff as diff_module

    monkeypatch.setattr(diff_module, 'DIFF_CHUNK', 7)
    x = np.arange(50, dtype=np.float32)
    y = x.copy()
    y[[3, 20, 49]] += np.float32([1, 2, 3])
    d = diff(write(tmp_path / 'a.jckpt', {'x': x}), write(tmp_path / 'b.jckpt', {'x': y})).entries[0]
    assert (d.mismatched, d.max_abs) == (3, 3.0)


# --- rewrite -------------------------------------------------------------------

def test_merge_renumbers_ids_and_keeps_bytes(tmp_path):
    a = write(tmp_path / 'a.jckpt', {'x': np.arange(3.0)}, metadata={'k': 'a'})
    b = write(tmp_path / 'b.jckpt', {'y': np.arange(5, dtype=np.int16)}, metadata={'k': 'b', 'm': '1'})
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
    a = write(tmp_path / 'a.jckpt', {'p/w': np.ones(2, np.float32)})
    out = tmp_path / 'out.jckpt'
    merge(out, [a, a], ['teacher', 'student'], durable=False)
    ctx, t1 = jckpt.load(jckpt.Context(host=True), a, prefix_namespace='teacher')
    ctx, t2 = jckpt.load(ctx, a, prefix_namespace='student')
    _, merged = jckpt.load(jckpt.Context(host=True), out)
    assert sorted(merged) == sorted({**t1, **t2}) == ['student__jckpt', 'teacher__jckpt']


def test_relayout_in_place(tmp_path):
    a = write(tmp_path / 'a.jckpt', {'x': np.arange(10.0)}, alignment=1)
    before = info(a).entries[0].checksum
    relayout(a, a, alignment=512, durable=False)
    s = info(a)
    assert s.alignment == 512 and s.data_start % 512 == 0 and s.entries[0].checksum == before
    assert verify(a).ok


# --- progress -------------------------------------------------------------------

def test_save_and_load_progress(tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    path = tmp_path / 's.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones((64, 64), np.float32)}, path, progress=True)
    jckpt.load(jckpt.Context(host=True), path, progress=True)
    jckpt.verify(path, progress=True)
    shown = terminal.getvalue()
    assert 'saving s.jckpt' in shown and 'loading s.jckpt' in shown and 'verifying s.jckpt' in shown


def test_library_prints_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv('CI', raising=False)
    path = tmp_path / 'q.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(3, np.float32)}, path, progress=True)  # not a tty
    jckpt.load(jckpt.Context(host=True), path, progress=True)
    repr(info(path))
    verify(path, progress=True)
    diff(path, path, progress=True)
    out, err = capsys.readouterr()
    assert out == '' and err == ''


def test_context_and_error_reprs(tmp_path):
    ctx = jckpt.Context()
    assert repr(ctx) == "Context(namespace='jckpt')"
    path = write(tmp_path / 'r.jckpt', {'a': np.ones(2), 'b': np.ones(2)})
    loaded, _ = jckpt.load(ctx.replace(host=True), path)
    assert repr(loaded) == "Context(namespace='jckpt', host=True, registry=Registry(2 entries in [jckpt]))"
    err = jckpt.ChecksumError('checksum mismatch', file='m.jckpt', entry='jckpt/w', fix='restore it')
    assert repr(err) == ("ChecksumError('checksum mismatch', file='m.jckpt', entry='jckpt/w', "
                         "fix='restore it')")
    assert str(err) == 'm.jckpt: entry jckpt/w: checksum mismatch (fix: restore it)'


def test_merge_keeps_the_ids_of_path_less_entries(tmp_path):
    """An OCANNL entry is named by its id (n<id>): merging renumbers the others around it."""
    from tests.helpers import entry_text, header_text, raw_file

    a = write(tmp_path / 'a.jckpt', {'x': np.ones(2, np.float32), 'y': np.ones(2, np.float32)})
    ocannl = tmp_path / 'o.ckpt'
    ocannl.write_bytes(raw_file(header_text(entry_text(id=1)), np.ones(1, np.float32).tobytes(),
                                align=4))
    header = merge(tmp_path / 'm.jckpt', [a, ocannl], durable=False)
    assert [(e.name, e.id) for e in header.tensors] == [('jckpt/x', 0), ('jckpt/y', 2),
                                                        ('jckpt/n1', 1)]
    assert verify(tmp_path / 'm.jckpt').ok


def test_info_names_another_format(tmp_path):
    npz = tmp_path / 'w.npz'
    np.savez(npz, w=np.ones(3))
    with pytest.raises(jckpt.FormatError, match='npz format') as e:
        info(npz)
    assert 'jckpt convert' in e.value.fix
