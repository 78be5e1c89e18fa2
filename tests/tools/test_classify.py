"""``classify(path)``: every kind of path, the error each non-checkpoint names, and that
nothing but a regular file is ever opened (a FIFO must not hang any tool)."""

import dataclasses
import os

import numpy as np
import pytest

import jckpt
from jckpt.errors import FormatError
from jckpt.format import Entry, Header, lay_out, prec_of
from jckpt.format.names import piece_name, step_name
from jckpt.storage import ArraySource, write_checkpoint
from jckpt.storage.directory import write_index
from jckpt.tools.classify import (
    DIRECTORY,
    FILE,
    FOREIGN,
    FORMAT_STEP,
    MANAGER,
    MISSING,
    NO_CHECKPOINT,
    UNFINISHED,
    UNKNOWN,
    UNREADABLE,
    Kind,
    classify,
)
from tests.helpers import entry_text, raw_file


def write(path, arrays, **piece):
    """A checkpoint file of ``{name: array}`` in namespace jckpt (``piece``: slice, global_dims)."""
    entries = [Entry(id=i, namespace='jckpt', prec=prec_of(a.dtype), dims=a.shape, offset=0,
                     byte_length=a.nbytes, path=(('k', name),), **piece)
               for i, (name, a) in enumerate(arrays.items())]
    write_checkpoint(path, lay_out(Header(tensors=tuple(entries))),
                     [ArraySource(a) for a in arrays.values()], durable=False)
    return str(path)


def write_directory(path):
    """A one-process directory checkpoint: one piece file holding all of ``w``, and the index."""
    os.makedirs(path)
    w = np.arange(4, dtype=np.float32)
    write(os.path.join(path, piece_name(0)), {'w': w}, slice=((0, 4),), global_dims=(4,))
    write_index(str(path), 1, 32, {}, durable=False)
    return str(path)


def test_jckpt_file(tmp_path):
    path = write(tmp_path / 'm.jckpt', {'w': np.ones(3, np.float32)})
    kind = classify(path)
    assert kind == Kind(FILE, path) and kind.error is None and kind.is_checkpoint
    assert classify(tmp_path / 'm.jckpt') == kind  # path-like objects too
    with pytest.raises(dataclasses.FrozenInstanceError):
        kind.name = MISSING


def test_file_whose_header_reads_though_it_starts_otherwise(tmp_path):
    """OCANNL may order a header's fields differently: the reader, not the first bytes, decides."""
    path = tmp_path / 'o.ckpt'
    path.write_bytes(raw_file(f"((alignment 1) (version 1) (tensors ({entry_text()})))",
                              np.ones(1, np.float32).tobytes()))
    assert classify(path).name == FILE


def test_directory_checkpoint(tmp_path):
    d = write_directory(tmp_path / 'sharded')
    assert classify(d) == Kind(DIRECTORY, d)
    write(os.path.join(d, step_name(1)), {'w': np.ones(1, np.float32)})
    assert classify(d).name == DIRECTORY  # an index wins over step names


def test_manager_directory(tmp_path):
    write(tmp_path / step_name(100), {'w': np.ones(1, np.float32)})
    (tmp_path / 'notes.txt').write_text('x')
    assert classify(tmp_path) == Kind(MANAGER, str(tmp_path))
    other = tmp_path / 'steps_as_directories'
    os.makedirs(other / step_name(5))  # a multi-process step is a directory
    assert classify(other).name == MANAGER


def test_directories_holding_no_checkpoint(tmp_path):
    d = write_directory(tmp_path / 'sharded')
    os.unlink(os.path.join(d, 'index.jckpt'))
    kind = classify(d)
    assert (kind.name, kind.detail) == (UNKNOWN, UNFINISHED) and not kind.is_checkpoint
    assert isinstance(kind.error, FormatError) and 'did not finish' in kind.error.message
    empty = tmp_path / 'empty'
    empty.mkdir()
    kind = classify(empty)
    assert (kind.name, kind.detail) == (UNKNOWN, NO_CHECKPOINT)
    assert kind.error.file == str(empty) and 'holds no checkpoint' in kind.error.message


def test_a_step_of_a_manager_writing_another_format_says_what_it_is(tmp_path):
    step = tmp_path / 'run' / step_name(3)
    step.mkdir(parents=True)
    for name in ('model.safetensors', 'optimizer.jckpt', 'trainer_state.json'):
        (step / name).write_bytes(b'{}')
    kind = classify(step)
    assert (kind.name, kind.detail) == (UNKNOWN, FORMAT_STEP) and not kind.is_checkpoint
    assert 'one step of a checkpoint manager' in kind.error.message
    assert str(tmp_path / 'run') in kind.error.fix


def test_foreign_files(tmp_path):
    npz = tmp_path / 'w.npz'
    np.savez(npz, w=np.zeros(3))
    kind = classify(npz)
    assert (kind.name, kind.detail) == (FOREIGN, 'npz')
    assert 'npz format, not a jckpt checkpoint' in kind.error.message
    assert f'jckpt convert {npz} w.jckpt' in kind.error.fix
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    st = tmp_path / 'w.safetensors'
    safetensors_numpy.save_file({'w': np.zeros(3, np.float32)}, str(st))
    assert (classify(st).name, classify(st).detail) == (FOREIGN, 'safetensors')


def test_the_commands_in_fixes_quote_paths_a_shell_would_split(tmp_path):
    """`jckpt convert my run/w.npz w.jckpt`, pasted into a shell, converts nothing."""
    import shlex

    from jckpt.api.multiprocess import save_directory
    from jckpt.tools.rewrite import relayout

    (tmp_path / 'my run').mkdir()
    npz = tmp_path / 'my run' / 'w 1.npz'
    np.savez(npz, w=np.zeros(3))
    fix = classify(npz).error.fix
    assert f"jckpt convert {shlex.quote(str(npz))} 'w 1.jckpt'" in fix
    command = fix.split('jckpt convert ', 1)[1].split(' (', 1)[0]
    assert shlex.split(command) == [str(npz), 'w 1.jckpt']
    directory = tmp_path / 'my run' / 'd'
    save_directory(jckpt.Context(), {'w': np.ones(2)}, directory)
    with pytest.raises(FormatError) as e:
        relayout(str(directory), str(tmp_path / 'out.jckpt'), alignment=64)
    assert f"jckpt convert {shlex.quote(str(directory))} whole.jckpt" in e.value.fix


def test_missing(tmp_path):
    kind = classify(tmp_path / 'gone.jckpt')
    assert kind.name == MISSING and kind.error.message == 'no such checkpoint file'
    assert kind.error.file == str(tmp_path / 'gone.jckpt') and kind.error.fix
    os.symlink(tmp_path / 'gone.jckpt', tmp_path / 'dangling.jckpt')
    assert classify(tmp_path / 'dangling.jckpt').name == MISSING


@pytest.mark.parametrize('data, message', [(b'', 'shorter than'), (b'\xff\xff', 'shorter than'),
                                           (b'\x00\x00\x00\x0c(not (closed', 'S-expression'),
                                           (b'\x00\x00\x00\xff', 'extends past the end')])
def test_unknown_file_carries_the_readers_error(tmp_path, data, message):
    path = tmp_path / 'bad.bin'
    path.write_bytes(data)
    kind = classify(path)
    assert (kind.name, kind.detail) == (UNKNOWN, UNREADABLE)
    assert isinstance(kind.error, FormatError) and message in kind.error.message
    assert kind.error.file == str(path)


@pytest.mark.timeout(60)
def test_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / 'pipe.jckpt'
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match='FIFO') as e:
        classify(fifo)  # opening it for reading would block until a writer came
    assert e.value.file == str(fifo) and e.value.fix


@pytest.mark.timeout(60)
def test_no_tool_hangs_on_a_fifo(tmp_path, capsys):
    import jckpt
    from jckpt.tools.cli import main
    from jckpt.tools.diff import diff
    from jckpt.tools.verify import verify

    fifo = tmp_path / 'pipe.jckpt'
    os.mkfifo(fifo)
    good = write(tmp_path / 'm.jckpt', {'w': np.ones(1, np.float32)})
    for call in (lambda: jckpt.info(fifo), lambda: diff(good, fifo)):
        with pytest.raises(FormatError, match='FIFO'):
            call()
    report = verify(fifo)  # verify never raises: a failed report says the same
    assert not report.ok and 'FIFO' in report.errors[0].message
    for argv in (['inspect', fifo], ['verify', fifo], ['diff', fifo, good],
                 ['convert', fifo, tmp_path / 'out.jckpt']):
        assert main([str(a) for a in argv]) == 2
        assert 'FIFO (named pipe), not a checkpoint file or directory' in capsys.readouterr().err


def test_character_device_is_refused():
    with pytest.raises(FormatError, match='character device'):
        classify(os.devnull)


def test_an_orbax_directory_is_foreign_as_a_safetensors_file_is(tmp_path, capsys):
    """inspect and verify said "directory holds no checkpoint" of what describe and load read."""
    pytest.importorskip('orbax.checkpoint')
    import jckpt
    from jckpt.tools.cli import main
    src = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(2)}, src)
    jckpt.convert(src, tmp_path / 'orb', format='orbax')
    kind = classify(str(tmp_path / 'orb'))
    assert (kind.name, kind.detail) == (FOREIGN, 'orbax')
    assert 'this directory is in orbax format' in kind.error.message
    assert main(['verify', str(tmp_path / 'orb')]) == 2
    assert 'jckpt convert' in capsys.readouterr().err
    assert main(['inspect', str(tmp_path / 'orb')]) == 0  # listed as the converter reads it
    assert 'orbax checkpoint, 1 array' in capsys.readouterr().out


def test_orbax_managers_directory_is_told_to_convert_a_step(tmp_path, capsys):
    """`jckpt inspect run` suggested `jckpt convert run run.jckpt`, which fails: a step
    converts, not the directory of steps."""
    ocp = pytest.importorskip('orbax.checkpoint')
    from jckpt.tools.cli import main
    with ocp.CheckpointManager(str(tmp_path / 'run')) as manager:
        for step in (2, 10):
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': np.ones(3)})))
    kind = classify(str(tmp_path / 'run'))
    assert (kind.name, kind.detail) == (FOREIGN, 'orbax')
    assert kind.error.message.startswith('this directory holds orbax steps (2, 10)')
    assert f"jckpt convert {tmp_path / 'run' / '10'} 10.jckpt" in kind.error.fix
    assert 'jckpt.restore' in classify(str(tmp_path / 'run' / '10')).error.fix
    assert main(['convert', str(tmp_path / 'run' / '10'), str(tmp_path / '10.jckpt')]) == 0
    (tmp_path / 'run' / '\u00b2').mkdir()  # a digit to str.isdigit, not to int()
    again = classify(str(tmp_path / 'run')).error.message
    assert again.startswith('this directory holds orbax steps (2, 10)')
    capsys.readouterr()


def test_a_prefix_in_a_bucket_carries_its_listing_for_the_tool_that_reads_it():
    pytest.importorskip("obstore")
    url = "memory://classify-listing/run"
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.ones(2)})
        mgr.save(2, {"w": np.ones(2)}, options=jckpt.CheckpointOptions(format="npz"))
    kind = classify(url)
    assert kind.name == MANAGER
    assert kind.listing == (["step_00000001.jckpt"], ["step_00000002.jckpt"])
    assert classify(f"{url}/step_00000001.jckpt").listing is None  # an object: no listing


def test_a_bucket_prefix_is_classified_in_one_round_trip_an_object_in_one_request(slow_s3):
    """`jckpt inspect s3://b/run` sent the GET of `run` as an object, then, once it was
    answered missing, the LIST: 2 round trips in turn. A name without a suffix is most often
    a prefix: both go at once. A name with one (`m.jckpt`) is most often an object: its GET
    alone, no LIST."""
    pytest.importorskip("obstore")
    s3, proxy = slow_s3
    with jckpt.CheckpointManager(f"{s3}/run") as mgr:
        mgr.save(1, {"w": np.ones(2)})
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, f"{s3}/m.jckpt")
    for url, kind, asked in ((f"{s3}/run", MANAGER, ["GET", "GET"]), (f"{s3}/m.jckpt", FILE, ["GET"]),
                             (f"{s3}/gone", MISSING, ["GET", "GET"])):
        proxy.rounds()  # waits for what the saves left in flight
        proxy.reset_counts()
        assert classify(url).name == kind
        assert ([m for m, _ in proxy.seen], proxy.rounds()) == (asked, 1), url


@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_tool_refuses_a_file_named_with_a_trailing_slash(where, tmp_path, capsys):
    """`info`, `verify`, `diff` and `inspect` of `memory://b/m.jckpt/` read the object
    `m.jckpt` silently, and `convert` of `m.jckpt/` locally was the OS's "not a directory":
    every tool now says what `load` says, with the path without the '/'."""
    from jckpt.tools.cli import main

    if where == "memory":
        pytest.importorskip("obstore")
    root = str(tmp_path) if where == "local" else "memory://classify-slash/run"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, f"{root}/m.jckpt")
    bad = f"{root}/m.jckpt/"
    for tool in (jckpt.info, jckpt.detect_format, lambda p: jckpt.diff(p, p),
                 lambda p: jckpt.convert(p, str(tmp_path / "m.npz")), classify):
        with pytest.raises(jckpt.InputError, match="'m.jckpt' is a checkpoint file") as e:
            tool(bad)
        assert e.value.fix == f"read '{root}/m.jckpt', without the trailing '/'"
    assert not jckpt.verify(bad).ok
    assert main(["inspect", bad]) == 2
    assert "without the trailing '/'" in capsys.readouterr().err
    assert classify(f"{root}/").name == UNKNOWN  # a directory named with its '/' is one still


def test_a_url_ending_with_a_slash_is_classified_in_one_round_trip(slow_s3):
    """`jckpt inspect s3://b/run/` sent a HEAD of `run` (is a file named as a folder?), then the
    GET and the LIST: 2 round trips in turn. The GET and the LIST tell it alone, at once; an
    object named with a '/' is still refused as every reader refuses it."""
    pytest.importorskip("obstore")
    s3, proxy = slow_s3
    with jckpt.CheckpointManager(f"{s3}/run") as mgr:
        mgr.save(1, {"w": np.ones(2)})
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, f"{s3}/m.jckpt")
    for url, kind in ((f"{s3}/run/", MANAGER), (f"{s3}/gone/", MISSING), (f"{s3}/m.jckpt/", None)):
        proxy.rounds()  # waits for what the saves left in flight
        proxy.reset_counts()
        if kind is None:
            with pytest.raises(jckpt.InputError, match="'m.jckpt' is a checkpoint file"):
                classify(url)
        else:
            assert classify(url).name == kind
        assert ([m for m, _ in proxy.seen], proxy.rounds()) == (["GET", "GET"], 1), url
