"""``jckpt.info`` (jckpt.tools.info): the summary that fits what is at a path; and, across the
read-only tools, progress bars only on a terminal and nothing printed by the library."""


import numpy as np
import pytest

import jckpt
from jckpt.format.names import step_name
from jckpt.tools.diff import diff
from jckpt.tools.info import info
from jckpt.tools.manager_info import ManagerInfo
from jckpt.tools.summary import DirectoryInfo, FileInfo
from jckpt.tools.verify import verify
from tests.helpers import on_terminal, write_directory
from tests.helpers import write_arrays as write

# --- info --------------------------------------------------------------------

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


def test_info_picks_the_summary_that_fits_the_path(tmp_path):
    f = write(tmp_path / 'm.jckpt', {'w': np.ones(3, np.float32)})
    assert isinstance(info(f), FileInfo) and info(f).path == f
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(4.0)})
    assert isinstance(info(d), DirectoryInfo) and info(d).path == d
    steps = tmp_path / 'run'
    steps.mkdir()
    write(steps / step_name(1), {'w': np.zeros(1)}, metadata={'jckpt.metrics': '{"loss": 2, "acc": 0.1}'})
    write(steps / step_name(2), {'w': np.zeros(1)}, metadata={'jckpt.metrics': '{"loss": 1, "acc": 0.0}'})
    m = info(steps)
    assert isinstance(m, ManagerInfo) and (m.best_metric, m.best_mode, m.best) == ('loss', 'min', 2)
    m = info(steps, best_metric='acc', best_mode='max')  # passed on to the manager's summary
    assert (m.best_metric, m.best_mode, m.best) == ('acc', 'max', 1)
    assert info(tmp_path / 'm.jckpt', best_metric='ignored').kind == 'file'  # only for a manager


def test_info_of_a_directory_holding_no_checkpoint(tmp_path):
    with pytest.raises(jckpt.FormatError, match='holds no checkpoint') as e:
        info(tmp_path)
    assert e.value.file == str(tmp_path)
    (tmp_path / 'process_00000.jckpt').write_bytes(b'x')
    with pytest.raises(jckpt.FormatError, match='did not finish'):
        info(tmp_path)


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


def test_info_lists_another_format(tmp_path):
    npz = tmp_path / 'w.npz'
    np.savez(npz, w=np.ones(3))
    summary = info(npz)  # the arrays as the converter reads them (tests/tools/test_foreign_info.py)
    assert summary.kind == 'foreign' and summary.format == 'npz'
    assert 'jckpt convert makes it a jckpt file' in repr(summary)
    assert not verify(npz).ok  # and the command line's verify names it (tests/tools/test_cli.py)
