"""``jckpt.api.progress``: bars only when asked for and on an interactive terminal, on stderr."""

import io
import os
import subprocess
import sys
import textwrap

import pytest

from jckpt.api import progress
from tests.helpers import FakeTerminal, on_terminal


def test_progress_wanted_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv('CI', raising=False)
    monkeypatch.setenv('TERM', 'xterm')
    assert not progress.wanted(True, io.StringIO())
    assert progress.wanted(True, FakeTerminal())
    assert not progress.wanted(False, FakeTerminal())
    monkeypatch.setenv('CI', 'true')
    assert not progress.wanted(True, FakeTerminal())
    monkeypatch.setenv('CI', '')
    monkeypatch.setenv('TERM', 'dumb')
    assert not progress.wanted(True, FakeTerminal())


@pytest.mark.parametrize('ci,wanted', [('0', True), ('false', True), ('No', True), ('FALSE', True),
                                       ('1', False), ('yes', False), ('github', False)])
def test_ci_counts_unless_it_says_no(monkeypatch, ci, wanted):
    monkeypatch.setenv('TERM', 'xterm')
    monkeypatch.setenv('CI', ci)
    assert progress.wanted(True, FakeTerminal()) is wanted


class Failing(FakeTerminal):
    """A terminal whose ``isatty`` fails (a closed stream, a detached descriptor)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def isatty(self):
        raise self.error


@pytest.mark.parametrize('stream', [Failing(ValueError('I/O operation on closed file')),
                                    Failing(OSError(9, 'Bad file descriptor')),
                                    object()],  # no isatty at all
                         ids=['closed', 'bad-descriptor', 'no-isatty'])
def test_a_stream_that_cannot_say_is_no_terminal(monkeypatch, stream):
    monkeypatch.delenv('CI', raising=False)
    monkeypatch.setenv('TERM', 'xterm')
    assert progress.wanted(True, stream) is False


def test_stderr_is_the_default_stream(monkeypatch):
    on_terminal(monkeypatch)
    assert progress.wanted(True)
    monkeypatch.setattr('sys.stderr', io.StringIO())
    assert not progress.wanted(True)


def test_bar_draws_on_a_terminal(monkeypatch):
    terminal = on_terminal(monkeypatch)
    with progress.bar('copying x', total=1000) as b:
        assert b.drawn
        b.advance(600)
        b.advance(400)
    assert b.done == 1000 and not b.drawn
    assert 'copying x' in terminal.getvalue()


def test_bar_draws_on_the_stream_given(monkeypatch):
    monkeypatch.delenv('CI', raising=False)
    monkeypatch.setenv('TERM', 'xterm')
    terminal = FakeTerminal()
    with progress.bar('reading y', total=0, stream=terminal) as b:  # an unknown total
        assert b.drawn
        b.advance(10)
    b.close()  # closing twice is fine
    assert 'reading y' in terminal.getvalue() and b.done == 10


def test_a_bar_not_asked_for_is_a_silent_counter(monkeypatch):
    terminal = on_terminal(monkeypatch)
    with progress.bar('saving m.jckpt', total=-5, enabled=False) as b:
        assert not b.drawn
        b.advance(3)
        b.advance(4)
    assert (b.done, b.total) == (7, 0)
    assert repr(b) == "Bar('saving m.jckpt', 7/0 bytes, drawn=False)"
    assert terminal.getvalue() == ''


RICH_IMPORT = textwrap.dedent("""
    import io, os, sys
    os.environ.pop('CI', None)
    os.environ['TERM'] = 'xterm'
    from jckpt.api import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    with progress.bar('a', 10, stream=io.StringIO()) as b:
        b.advance(10)
    with progress.bar('b', 10, enabled=False, stream=Tty()):
        pass
    print('rich' in sys.modules)
    with progress.bar('c', 10, stream=Tty()):
        pass
    print('rich' in sys.modules)
""")


def test_rich_is_imported_only_to_draw():
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, '-c', RICH_IMPORT], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert out.split() == ['False', 'True']


def test_a_load_drawing_a_bar_asks_the_kernel_for_the_pages_it_reads_alone(tmp_path, monkeypatch):
    """A `load` that draws a bar decodes its entries one by one; of one namespace of a file it
    still advises the kernel of that namespace's pages alone (the read-around about each
    payload read the other namespace's too), and of the whole file nothing."""
    import numpy as np

    import jckpt
    from jckpt.storage import reader as reader_mod
    path = tmp_path / 'two.jckpt'
    big = {n: np.full(300_000, i, np.float32) for i, n in enumerate('ab')}  # 1.2 MB each
    jckpt.save(jckpt.Context(namespace='model'), big, path)
    jckpt.save(jckpt.Context(namespace='opt'), big, path, appending=True)
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n)))
    on_terminal(monkeypatch)
    _, tree = jckpt.load(jckpt.Context(), path, namespaces='model', progress=True)
    assert float(tree['model']['b'][0]) == 1
    r = reader_mod.CheckpointReader(path)
    model = [e for e in r.header.tensors if e.namespace == 'model']
    assert advised and sum(n for _, n in advised) < 2 * big['a'].nbytes + 4 * 4096
    assert all(any(r.data_start + e.offset - 4096 < s < r.data_start + e.offset + e.byte_length
                   for e in model) for s, _ in advised), advised
    advised.clear()
    jckpt.load(jckpt.Context(), path, progress=True)
    assert advised == []
