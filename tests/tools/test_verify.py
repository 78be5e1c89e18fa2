"""Checking checkpoints without JAX (jckpt.tools.verify): layout, checksums, directories, steps."""

import json
import os
import shutil

import numpy as np
import pytest

import jckpt
from jckpt.format.names import step_name
from jckpt.storage import CheckpointReader
from jckpt.tools.verify import Problem, VerifyReport, verify
from tests.helpers import (
    corrupt_payload,
    entry_text,
    header_text,
    raw_file,
    write_arrays,
    write_directory,
)

# --- a file ------------------------------------------------------------------------------------

def test_verify_report(tmp_path):
    path = write_arrays(tmp_path / 'm.jckpt', {'a': np.arange(4.0), 'b': np.arange(3, dtype=np.int8)})
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
    assert not verify(tmp_path / 'nope.jckpt').ok


def test_verify_unchecked_entries_are_warnings(tmp_path):
    path = tmp_path / 'old.ckpt'
    path.write_bytes(raw_file(header_text(entry_text()), np.ones(1, np.float32).tobytes(), align=4))
    r = verify(path)
    assert r.ok and r.checked == 0 and r.unchecked == ('jckpt/n0',)
    assert any('no checksum' in p.message for p in r.warnings)


def test_a_good_file(tmp_path):
    path = write_arrays(tmp_path / 'm.jckpt', {'a': np.arange(4.0), 'b/c': np.ones((2, 2), np.int8)})
    r = verify(path)
    assert isinstance(r, VerifyReport)
    assert (r.ok, r.path, r.entries, r.checked, r.unchecked, r.problems, r.files) == (
        True, path, 2, 2, (), (), 1)
    assert r.render() == f"OK: {path}: 2 of 2 checksums verified, 0 errors, 0 warnings"
    assert repr(r) == r.render()
    assert json.loads(json.dumps(r.to_dict())) == {
        'path': path, 'ok': True, 'files': 1, 'entries': 2, 'checked': 2, 'unchecked': [],
        'problems': []}


def test_every_damaged_payload_is_reported_not_only_the_first(tmp_path):
    path = write_arrays(tmp_path / 'm.jckpt', {'a': np.arange(4.0), 'b': np.ones(8),
                                               'c': np.zeros(2)})
    corrupt_payload(path, 'jckpt/a')
    corrupt_payload(path, 'jckpt/c')
    r = verify(path)
    assert [p.entry for p in r.errors] == ['jckpt/a', 'jckpt/c'] and r.checked == 1
    assert str(r.errors[0]).startswith(f"{path}: entry jckpt/a: checksum mismatch")
    text = r.render()
    assert text.startswith(f"ERROR: {path}: entry jckpt/a: checksum mismatch")
    assert text.endswith("FAILED: " + path + ": 1 of 3 checksums verified, 2 errors, 0 warnings")
    assert r.to_dict()['problems'][0]['severity'] == 'error'


def test_a_name_with_a_newline_cannot_forge_a_line_of_the_report(tmp_path):
    name = 'w\nOK: m.jckpt: 1 of 1 checksums verified, 0 errors, 0 warnings\nx'
    path = write_arrays(tmp_path / 'm.jckpt', {name: np.ones(2, np.float32)})
    corrupt_payload(path, f'jckpt/{name}')
    lines = verify(path).render().splitlines()
    assert len(lines) == 2 and lines[0].startswith('ERROR: ') and '\\nOK: ' in lines[0]
    assert lines[1].startswith('FAILED: ')


@pytest.mark.parametrize('data', [b'', b'garbage, not a checkpoint', b'\x00\x00\x00\x05(((('])
def test_an_unreadable_file_is_a_failed_report_not_an_exception(tmp_path, data):
    path = tmp_path / 'bad.jckpt'
    path.write_bytes(data)
    r = verify(path)
    assert not r.ok and r.entries == 0 and len(r.errors) == 1
    assert r.errors[0].file == str(path)


def test_a_truncated_file_fails(tmp_path):
    path = write_arrays(tmp_path / 'm.jckpt', {'a': np.arange(100.0)})
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
        f.write(data[:-10])
    r = verify(path)
    (error,) = r.errors
    assert (error.file, error.entry) == (path, 'jckpt/a')
    assert 'extends past the end of the file' in error.message and 'truncated' in error.message


def test_a_file_cut_inside_its_payloads_says_so(tmp_path):
    """The entries past the cut in file order (not an empty entry listed first), how many, the
    size expected and found, and the fix; the summary gives no made-up count of checksums."""
    text = header_text(entry_text(id=0, dims='(0)', offset=12, length=0),
                       entry_text(id=1, dims='(1)', offset=0, length=4),
                       entry_text(id=2, dims='(2)', offset=4, length=8))
    path = tmp_path / 'cut.jckpt'
    path.write_bytes(raw_file(text, b'\0' * 6))
    size = path.stat().st_size
    r = verify(path)
    (error,) = r.errors
    assert error.entry == 'jckpt/n2'
    assert f'the file is truncated: it is {size} bytes where its header describes {size + 6}' \
        in error.message
    assert '2 of 3 entries lie past its end' in error.message
    assert 'cut short' in error.message and 'restore it from another copy' in error.message
    assert r.render().endswith(f'FAILED: {path}: no checksum verified, 1 error, 0 warnings')


def test_layout_warnings(tmp_path):
    """A readable file not laid out as the writer lays it out: warnings, still ok."""
    text = header_text(
        entry_text(id=0, prec='Single_prec', dims='(1)', offset=0, length=4,
                   extra=' (checksum (md5 00))'),
        entry_text(id=1, prec='Single_prec', dims='(1)', offset=9, length=4),
        alignment='(alignment 8)')
    path = tmp_path / 'odd.ckpt'
    path.write_bytes(raw_file(text, b'\0' * 4 + b'\x01' * 5 + b'\0' * 4 + b'tail', align=8))
    r = verify(path)
    assert r.ok and r.errors == () and r.checked == 0 and r.unchecked == ('jckpt/n0', 'jckpt/n1')
    messages = [(p.entry, p.message) for p in r.warnings]
    assert ('jckpt/n1', 'payload at offset 9 is not aligned to 8 bytes; it is copied, not mapped') \
        in messages
    assert ('jckpt/n1', 'the 5 bytes before this payload are not zero-filled') in messages
    assert (None, '4 bytes follow the last payload') in messages
    assert ('jckpt/n0', "checksum algorithm 'md5' is unknown to this version; payload not checked") \
        in messages
    assert (None, "the header carries no checksum (written by an older or another writer, or "
                  "its checksum field is damaged): it was not checked") in messages
    assert r.render().endswith('0 of 2 checksums verified, 0 errors, 6 warnings')


def test_a_header_checksum_field_damaged_into_another_name_is_a_warning(tmp_path):
    """Its bytes no longer name the checksum, so the header reads unsealed: never silently ok."""
    path = write_arrays(tmp_path / 'm.jckpt', {'w': np.ones(3, np.float32)})
    assert not verify(path).warnings
    data = bytearray(open(path, 'rb').read())
    at = data.find(b'header_checksum')
    data[at + 7:at + 8] = b'X'  # header_Xhecksum: an unknown field, kept
    open(path, 'wb').write(data)
    r = verify(path)
    assert r.ok and r.warnings[0].message.startswith('the header carries no checksum')


def test_zero_gaps_are_checked_in_chunks(tmp_path, monkeypatch):
    import jckpt.tools.verify as verify_module

    monkeypatch.setattr(verify_module, 'GAP_CHUNK', 3)
    gap = bytearray(64)
    gap[50] = 1
    text = header_text(entry_text(id=0, prec='Single_prec', dims='(1)', offset=64, length=4))
    path = tmp_path / 'gap.ckpt'
    path.write_bytes(raw_file(text, bytes(gap) + b'\0' * 4, align=4))
    assert [p.message for p in verify(path).warnings if 'zero-filled' in p.message] == [
        'the 64 bytes before this payload are not zero-filled']


def test_a_foreign_file_is_reported_not_raised(tmp_path):
    npz = tmp_path / 'w.npz'
    np.savez(npz, w=np.ones(3))
    r = verify(npz)
    assert not r.ok and r.errors[0].file == str(npz)


def test_what_holds_no_checkpoint_is_a_failed_report(tmp_path):
    r = verify(tmp_path / 'missing.jckpt')
    assert not r.ok and r.errors[0].file == str(tmp_path / 'missing.jckpt')
    (tmp_path / 'empty').mkdir()
    r = verify(tmp_path / 'empty')
    assert not r.ok and 'holds no checkpoint' in r.errors[0].message


# --- a directory checkpoint --------------------------------------------------------------------

ARRAYS = {'w': np.arange(24, dtype=np.float32).reshape(8, 3), 'b': np.arange(4, dtype=np.int32)}


def test_a_good_directory(tmp_path):
    d = write_directory(tmp_path / 'ckpt', ARRAYS, processes=2)
    r = verify(d)
    assert (r.ok, r.files, r.entries, r.checked, r.problems) == (True, 2, 4, 4, ())
    assert r.render() == f"OK: {d} (2 files): 4 of 4 checksums verified, 0 errors, 0 warnings"


def test_a_damaged_piece_of_a_directory_names_the_piece_file_and_entry(tmp_path):
    d = write_directory(tmp_path / 'ckpt', ARRAYS, processes=2)
    piece = os.path.join(d, 'process_00001.jckpt')
    corrupt_payload(piece, 'jckpt/w')
    r = verify(d)
    assert not r.ok and r.checked == 3 and r.files == 2
    (error,) = r.errors
    assert (error.file, error.entry) == (piece, 'jckpt/w')
    assert 'checksum mismatch' in error.message
    assert r.render().startswith(f"ERROR: {piece}: entry jckpt/w: checksum mismatch")


def test_a_missing_piece_file_and_an_unlisted_one(tmp_path):
    d = write_directory(tmp_path / 'ckpt', ARRAYS, processes=2)
    os.unlink(os.path.join(d, 'process_00000.jckpt'))
    with open(os.path.join(d, 'process_00007.jckpt'), 'wb') as f:
        f.write(b'x')
    r = verify(d)
    assert not r.ok and r.files == 1
    assert [(p.severity, p.file, p.message) for p in r.problems] == [
        ('error', d, 'piece file process_00000.jckpt listed in the index is missing'),
        ('warning', d, 'piece file process_00007.jckpt is not listed in index.jckpt')]


def test_a_piece_file_that_does_not_hold_what_the_index_says(tmp_path):
    d = write_directory(tmp_path / 'ckpt', ARRAYS, processes=2)
    shutil.copy(os.path.join(d, 'process_00000.jckpt'), os.path.join(d, 'process_00001.jckpt'))
    r = verify(d)
    assert not r.ok and r.checked == 4  # each file is sound on its own
    assert sorted((p.entry, p.message) for p in r.errors) == [
        ('jckpt/b', 'piece [(2, 4)] is not in process_00001.jckpt as the index says'),
        ('jckpt/w', 'piece [(4, 8), (0, 3)] is not in process_00001.jckpt as the index says')]


def test_an_unreadable_piece_file_or_index(tmp_path):
    d = write_directory(tmp_path / 'ckpt', ARRAYS, processes=2)
    piece = os.path.join(d, 'process_00001.jckpt')
    with open(piece, 'wb') as f:
        f.write(b'garbage')
    r = verify(d)
    assert not r.ok and [p.file for p in r.errors] == [piece] and r.checked == 2
    with open(os.path.join(d, 'index.jckpt'), 'wb') as f:
        f.write(b'garbage')
    r = verify(d)
    assert not r.ok and r.errors[0].file == os.path.join(d, 'index.jckpt')


def test_an_unfinished_save_is_a_failed_report(tmp_path):
    d = tmp_path / 'ckpt'
    d.mkdir()
    (d / 'process_00000.jckpt').write_bytes(b'x')
    r = verify(d)
    assert not r.ok and 'did not finish' in r.errors[0].message and r.errors[0].file == str(d)


# --- a manager's directory ---------------------------------------------------------------------

def test_a_manager_directory_is_checked_step_by_step(tmp_path):
    for step in (1, 2, 3):
        write_arrays(tmp_path / step_name(step), {'w': np.full(3, step, np.float32)})
    write_directory(tmp_path / step_name(4), ARRAYS, processes=2)
    r = verify(tmp_path)
    assert r.ok and r.files == 5 and r.entries == 7 and r.checked == 7
    corrupt_payload(str(tmp_path / step_name(2)), 'jckpt/w')
    r = verify(tmp_path)
    assert not r.ok and [p.file for p in r.errors] == [str(tmp_path / step_name(2))]
    assert f"({r.files} files)" in r.render()


def test_a_step_linking_back_to_its_manager_directory_is_reported_not_followed(tmp_path):
    """Verifying the link verified the directory again, and so on until RecursionError, which
    verify let out (two such links: exponential time; found by the manager-directory fuzzer).
    A link to another step of the directory is followed, as the manager follows it."""
    write_arrays(tmp_path / step_name(1), {'w': np.ones(3, np.float32)})
    os.symlink(tmp_path, tmp_path / step_name(2))
    os.symlink(step_name(1), tmp_path / step_name(3))
    r = verify(tmp_path)
    assert [p.file for p in r.errors] == [str(tmp_path / step_name(2))]
    assert "outside the manager's directory" in r.errors[0].message
    assert r.checked == 2


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_steps_of_a_manager_writing_another_format_are_verified(tmp_path, fmt):
    """The model file is read whole by its format's reader (a warning: no jckpt checksums),
    the optimizer file verified; a damaged model file is an error naming it."""
    with jckpt.CheckpointManager(tmp_path, options=jckpt.CheckpointOptions(format=fmt)) as mgr:
        for step in (1, 2):
            mgr.save(step, items={"model": {"w": np.full(3, step, np.float32)},
                                  "opt": {"mu": np.ones(2, np.float32)}})
    r = verify(tmp_path)
    assert r.ok and r.files == 4 and r.entries == 4 and r.checked == 2, r.render()
    assert [p.severity for p in r.problems] == ["warning"] * 2
    assert "stores no jckpt checksums" in r.problems[0].message
    step = tmp_path / step_name(2)
    assert verify(step).ok and verify(step).files == 2
    model = next(p for p in step.iterdir() if p.name.startswith("model."))
    model.write_bytes(model.read_bytes()[:20])
    r = verify(tmp_path)
    assert not r.ok and [p.file for p in r.errors] == [str(model)]


@pytest.mark.slow
def test_steps_of_another_format_are_verified_in_an_object_store(s3):
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url, options=jckpt.CheckpointOptions(format="safetensors")) as mgr:
        mgr.save(1, items={"model": {"w": np.ones(3, np.float32)}, "opt": {"mu": np.ones(2)}})
    r = verify(url)
    assert r.ok and r.files == 2 and r.checked == 1, r.render()
    assert "stores no jckpt checksums" in r.problems[0].message


def test_the_tools_read_an_object_with_one_get(s3, s3_server, capsys):
    """Each tool asked a HEAD (is an object there?), read the header to classify it, then read
    it again to do its work: `verify` of a small file took 3 requests, `jckpt verify` 5."""
    from jckpt.tools.cli import main
    url = f"{s3}/run/model.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.arange(8, dtype=np.float32)}, url)
    for run in (lambda: verify(url), lambda: jckpt.info(url), lambda: main(["verify", url]),
                lambda: main(["inspect", url])):
        before = len(s3_server.requests(s3))
        run()
        assert s3_server.requests(s3)[before:] == ["GET /run/model.jckpt"]
    before = len(s3_server.requests(s3))
    assert jckpt.diff(url, url).same
    assert s3_server.requests(s3)[before:] == ["GET /run/model.jckpt"] * 2
    assert "OK" in capsys.readouterr().out


# --- the values --------------------------------------------------------------------------------

def test_problem_and_report_values():
    p = Problem('warning', 'odd', 'f.jckpt')
    assert str(p) == 'f.jckpt: odd'
    assert str(Problem('error', 'bad', 'f.jckpt', 'jckpt/w')) == 'f.jckpt: entry jckpt/w: bad'
    r = VerifyReport('f.jckpt', 1, 1, (), (p,))
    assert r.ok and r.warnings == (p,) and r.errors == ()
    assert r.render() == 'WARNING: f.jckpt: odd\nOK: f.jckpt: 1 of 1 checksums verified, 0 errors, 1 warning'


def test_verifying_a_manager_of_foreign_format_steps_needs_no_jax(tmp_path):
    """verify imported the services (and so JAX) only to read a step's record."""
    import subprocess
    import sys

    import numpy as np

    import jckpt
    with jckpt.CheckpointManager(tmp_path / 'run', options=jckpt.CheckpointOptions(format='npz')) as mgr:
        mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': {'m': np.ones(2)}})
    code = ("import sys; from jckpt.tools.verify import verify\n"
            f"assert verify({str(tmp_path / 'run')!r}).ok\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == '[]'


def test_a_step_whose_record_is_a_fifo_or_names_no_model_is_reported(tmp_path):
    """A FIFO as trainer_state.json blocked verify for ever; a record naming '..' as the
    model failed on an AssertionError."""
    import json
    with jckpt.CheckpointManager(tmp_path, options=jckpt.CheckpointOptions(format="npz")) as mgr:
        mgr.save(1, {"w": np.ones(2, np.float32)})
        mgr.save(2, {"w": np.ones(2, np.float32)}, force=True)
    record = tmp_path / step_name(1) / "trainer_state.json"
    text = json.loads(record.read_text())
    record.write_text(json.dumps({**text, "model": ".."}))
    fifo = tmp_path / step_name(2) / "trainer_state.json"
    fifo.unlink()
    os.mkfifo(fifo)
    r = verify(tmp_path)
    assert not r.ok and {p.file for p in r.errors} == {str(record), str(fifo)}, r.render()
