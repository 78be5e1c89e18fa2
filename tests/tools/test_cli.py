"""The ``jckpt`` command line, run as a subprocess on real files.

Each subcommand is checked for its output and exit status on good, corrupt,
truncated and missing files; progress bars must appear under a
pseudo-terminal and never in a pipe.
"""

import argparse
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from jckpt.storage import CheckpointReader
from tests.helpers import write_arrays, write_directory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 60


def _env(**changes):
    env = dict(os.environ)
    env['PYTHONPATH'] = REPO + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    env.setdefault('JAX_PLATFORMS', 'cpu')
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def jckpt_cmd(*args, cwd=None, env=None):
    """Run ``python -m jckpt ARGS``; return the completed process (text output)."""
    return subprocess.run([sys.executable, '-m', 'jckpt', *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=cwd, env=env or _env())


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """Run ``jckpt ARGS`` in this process (fast); the subprocess form is ``jckpt_cmd``."""
    from jckpt.tools.cli import main

    def run(*args):
        capsys.readouterr()
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out, err = capsys.readouterr()
        return Result(rc, out, err)
    return run


write = write_arrays  # a checkpoint of {'a/b': array}, written by the storage layer



ARRAYS = {
    'params/w': np.arange(12, dtype=np.float32).reshape(3, 4),
    'params/b': np.zeros(4, np.float32),
    'step': np.array(7, np.int32),
}


@pytest.fixture
def model(tmp_path):
    return write(tmp_path / 'model.jckpt', ARRAYS,
                 metadata={'jckpt.trainer_state': json.dumps({'global_step': 7}),
                           'jckpt.lineage': 'abc123', 'jckpt.generation': '4', 'note': 'hello'})


def corrupt_payload(path, name):
    """Flip one byte of entry ``name``'s payload in place."""
    reader = CheckpointReader(path)
    entry = next(e for e in reader.header.tensors if e.name == name)
    where = reader.data_start + entry.offset
    del reader
    with open(path, 'r+b') as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def one_line_error(proc, *needles):
    """The process failed with status 2 and one error line (no traceback) containing needles."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith('jckpt: error: ')
    assert 'Traceback' not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert proc.stdout == ''


# --- inspect -----------------------------------------------------------------

def test_inspect_table(model):
    p = jckpt_cmd('inspect', model)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ''
    out = p.stdout
    header = next(line for line in out.splitlines() if line.startswith('namespace'))
    assert header.split() == ['namespace', 'path', 'dtype', 'shape', 'size', 'offset', 'map']
    rows = {line.split()[1]: line.split() for line in out.splitlines()
            if line.startswith('jckpt ')}
    assert rows['params/w'][2:4] == ['float32', '(3,']  # shape "(3, 4)"
    assert rows['params/w'][-1] == 'yes' and rows['params/w'][-2] == '0'
    assert rows['params/b'][-2] == '64'          # after 48 bytes, aligned to 32
    assert rows['step'][2:4] == ['int32', '()']
    assert 'writer: jckpt test' in out
    assert 'trainer state: {"global_step": 7}' in out
    assert 'lineage: abc123' in out and 'generation: 4' in out and 'note: hello' in out
    assert 'total: 3 entries, 68 B (68 bytes), 3 of 3 mappable' in out


def test_inspect_json(model, cli):
    p = cli('inspect', model, '--json')
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data['kind'] == 'file' and data['alignment'] == 32
    assert data['size'] == os.path.getsize(model)
    assert data['trainer_state'] == {'global_step': 7}
    assert data['lineage'] == 'abc123' and data['generation'] == 4
    by_path = {e['path']: e for e in data['entries']}
    assert by_path['params/w']['shape'] == [3, 4]
    assert by_path['params/w']['nbytes'] == 48 and by_path['params/w']['dtype'] == 'float32'
    assert by_path['params/w']['checksum'].startswith('xxh3_64:')
    assert data['totals'] == {'entries': 3, 'payload_bytes': 68, 'mappable': 3,
                              'namespaces': {'jckpt': 3}}


def test_inspect_json_is_strict_json_with_non_finite_metrics(tmp_path, cli):
    """The bare `NaN` an earlier manager wrote in a step's metrics was printed as is, which
    strict JSON parsers (jq) refuse; it is printed tagged, as jckpt now stores it."""
    path = write(tmp_path / 'm.jckpt', {'w': np.zeros(2, np.float32)},
                 metadata={'jckpt.metrics': '{"loss": NaN, "acc": {"$float": "inf"}}',
                           'jckpt.trainer_state': '{"best_loss": -Infinity}'})
    p = cli('inspect', path, '--json')
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout, parse_constant=lambda token: pytest.fail(f"{token} printed"))
    assert data['metrics'] == {'loss': {'$float': 'nan'}, 'acc': {'$float': 'inf'}}
    assert data['trainer_state'] == {'best_loss': {'$float': '-inf'}}


def test_inspect_shows_a_typed_keys_array_shape_in_text_and_json(tmp_path, cli):
    """A scalar key was listed with its key data's shape `(2,)`; `verify` names no shape."""
    import jax

    import jckpt
    path = tmp_path / 'keys.jckpt'
    jckpt.save(jckpt.Context(), {'k': jax.random.key(0),
                                 'ks': jax.random.split(jax.random.key(1), 3)}, path)
    rows = {line.split()[1]: line.split()[2:4] for line in cli('inspect', path).stdout.splitlines()
            if line.startswith('jckpt ')}
    assert rows == {'k': ['key<threefry2x32>', '()'], 'ks': ['key<threefry2x32>', '(3,)']}
    entries = json.loads(cli('inspect', path, '--json').stdout)['entries']
    assert [(e['shape'], e['key_impl']) for e in entries] == [([], 'threefry2x32'),
                                                              ([3], 'threefry2x32')]
    assert cli('verify', path).returncode == 0


def test_inspect_unmappable_payload(tmp_path, cli):
    """A float32 payload at an odd absolute offset (alignment 1) is reported as copied."""
    path = write(tmp_path / 'odd.jckpt', {'b': np.ones(3, np.uint8), 'w': np.ones(2, np.float32)},
                 alignment=1)
    reader = CheckpointReader(path)
    w = next(e for e in reader.header.tensors if e.name == 'jckpt/w')
    odd = (reader.data_start + w.offset) % 4 != 0
    data = json.loads(cli('inspect', path, '--json').stdout)
    assert {e['path']: e['mappable'] for e in data['entries']} == {'b': True, 'w': not odd}
    assert data['totals']['mappable'] == (1 if odd else 2)


def test_inspect_missing_file(tmp_path):
    missing = tmp_path / 'nope.jckpt'
    one_line_error(jckpt_cmd('inspect', missing), str(missing), 'no such checkpoint file', 'fix:')


def test_inspect_truncated_file(model, cli):
    size = os.path.getsize(model)
    with open(model, 'r+b') as f:
        f.truncate(size - 10)
    one_line_error(cli('inspect', model), model, 'extends past the end', 'truncated')


@pytest.mark.parametrize('ext', ['npz', 'pt', 'safetensors'])
def test_another_formats_file_cut_short_is_named_so_by_every_command(tmp_path, cli, ext):
    """A zip archive without its end, a safetensors file shorter than its header: each command
    said "no format jckpt recognises (fix: pass format=...)" or "convert it first"."""
    import jckpt
    whole = tmp_path / f'm.{ext}'
    jckpt.adapters.write({'jckpt': {'w': np.ones((64, 64), np.float32), 'b': np.ones(3)}}, whole)
    cut = tmp_path / f'cut.{ext}'
    cut.write_bytes(whole.read_bytes()[:os.path.getsize(whole) // 2 if ext != 'safetensors' else 40])
    for args, rc in ((('inspect', cut), 2), (('diff', cut, whole), 2),
                     (('convert', cut, tmp_path / 'out.jckpt'), 2), (('verify', cut), 1)):
        r = cli(*args)
        said = r.stdout + r.stderr
        assert r.returncode == rc, (args, r)
        assert 'the file is cut short' in said and str(cut) in said, (args, r)
        assert 'convert it first' not in said and 'format=' not in said


def test_inspect_garbage_and_debug(tmp_path):
    bad = tmp_path / 'bad.jckpt'
    bad.write_bytes(b'\x00\x00\x00\x0c(not (closed')
    one_line_error(jckpt_cmd('inspect', bad), str(bad), 'S-expression')
    p = jckpt_cmd('--debug', 'inspect', bad)  # the traceback, then the same line and status
    assert p.returncode == 2 and 'Traceback' in p.stderr and 'FormatError' in p.stderr
    assert p.stderr.rstrip().splitlines()[-1].startswith('jckpt: error: ')
    p = jckpt_cmd('inspect', bad, '--debug', '-v')  # accepted after the subcommand too
    assert 'Traceback' in p.stderr


def test_inspect_plain_directory_is_refused(tmp_path, cli):
    one_line_error(cli('inspect', tmp_path), str(tmp_path), 'no checkpoint')


def _step_file(directory, step, loss, *, lineage='L1'):
    return write(os.path.join(directory, f'step_{step:08d}.jckpt'),
                 {'w': np.full(3, step, np.float32)},
                 metadata={'jckpt.step': str(step), 'jckpt.metrics': json.dumps({'loss': loss}),
                           'jckpt.lineage': lineage, 'jckpt.generation': str(step // 10)})


def test_inspect_manager_directory(tmp_path, cli):
    d = tmp_path / 'run'
    d.mkdir()
    for step, loss in ((10, 0.5), (20, 0.25), (30, 0.4)):
        _step_file(d, step, loss)
    (d / 'step_00000040.jckpt').write_bytes(b'\x00\x00')  # damaged: listed, never latest
    (d / 'unrelated.txt').write_text('x')
    p = jckpt_cmd('inspect', d)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert 'checkpoint manager directory, 4 steps' in lines[0]
    assert 'latest 30' in lines[0] and 'best 20 by loss (min)' in lines[0]
    assert 'lineage: L1' in p.stdout
    rows = {line.split()[0]: line for line in lines if line.strip()[:2].isdigit()}
    assert set(rows) == {'10', '20', '30', '40'}
    assert rows['20'].rstrip().endswith('best') and rows['30'].rstrip().endswith('latest')
    assert 'unreadable' in rows['40']
    data = json.loads(cli('inspect', d, '--json', '--best-mode', 'max').stdout)
    assert data['kind'] == 'manager' and data['latest'] == 30 and data['best'] == 10
    assert [s['step'] for s in data['steps']] == [10, 20, 30, 40]
    assert data['steps'][1]['metrics'] == {'loss': 0.25} and data['steps'][1]['generation'] == 2
    assert data['steps'][3]['error']
    one_line_error(cli('diff', d, d), 'one checkpoint per step', 'step_00000010.jckpt')


def test_directory_checkpoint(tmp_path, cli):
    arrays = {'params/w': np.arange(24, dtype=np.float32).reshape(6, 4), 'b': np.arange(4.0)}
    d = write_directory(tmp_path / 'sharded', arrays, metadata={'jckpt.step': '5'})
    p = jckpt_cmd('inspect', d)
    assert p.returncode == 0, p.stderr
    assert 'multi-process checkpoint directory, 2 arrays in 1 namespace' in p.stdout
    assert 'step: 5' in p.stdout and 'process_00001.jckpt' in p.stdout
    row = next(line for line in p.stdout.splitlines() if 'params/w' in line).split()
    assert row[2:5] == ['float32', '(6,', '4)'] and row[-2:] == ['2', 'yes']  # pieces, map
    data = json.loads(cli('inspect', d, '--json').stdout)
    assert data['kind'] == 'directory' and data['step'] == 5
    assert [a['shape'] for a in data['arrays']] == [[6, 4], [4]]
    assert [f['name'] for f in data['files']] == ['process_00000.jckpt', 'process_00001.jckpt']

    assert cli('verify', d).returncode == 0
    # one file: consolidated by convert, equal to the directory
    one = tmp_path / 'one.jckpt'
    assert cli('convert', d, one).returncode == 0
    assert cli('diff', d, one).returncode == 0
    assert json.loads(cli('inspect', one, '--json').stdout)['metadata'] == {'jckpt.step': '5'}

    # a checkpoint's own files must not be symbolic links
    piece = os.path.join(d, 'process_00000.jckpt')
    os.rename(piece, tmp_path / 'elsewhere.jckpt')
    os.symlink(tmp_path / 'elsewhere.jckpt', piece)
    p = cli('verify', d)
    assert p.returncode == 1 and 'process_00000.jckpt' in p.stdout and 'symbolic link' in p.stdout
    one_line_error(cli('inspect', d), 'symbolic link')
    os.unlink(piece)
    os.rename(tmp_path / 'elsewhere.jckpt', piece)

    corrupt_payload(os.path.join(d, 'process_00001.jckpt'), 'jckpt/params/w')
    p = cli('verify', d)
    assert p.returncode == 1
    assert f"{d}/process_00001.jckpt: entry jckpt/params/w: checksum mismatch" in p.stdout
    os.unlink(os.path.join(d, 'index.jckpt'))  # an unfinished save is not a checkpoint
    assert 'did not finish' in cli('verify', d).stdout
    one_line_error(cli('inspect', d), 'no index.jckpt')


# --- verify ------------------------------------------------------------------

def test_verify_good(model):
    p = jckpt_cmd('verify', model)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f'OK: {model}: 3 of 3 checksums verified, 0 errors, 0 warnings'
    assert p.stderr == ''


def test_verify_truncated_file(model, cli):
    data = open(model, 'rb').read()
    with open(model, 'wb') as f:
        f.write(data[:-40])
    p = jckpt_cmd('verify', model)
    assert p.returncode == 1
    assert 'the file is truncated' in p.stdout and 'past its end' in p.stdout
    assert f'where its header describes {len(data)}' in p.stdout
    assert 'restore it from another copy' in p.stdout
    assert 'no checksum verified' in p.stdout and '0 of 0' not in p.stdout
    (problem,) = json.loads(cli('verify', model, '--json').stdout)['problems']
    assert problem['severity'] == 'error' and 'truncated' in problem['message']


def test_verify_corrupt_payload_names_entry(model, cli):
    corrupt_payload(model, 'jckpt/params/w')
    p = jckpt_cmd('verify', model)
    assert p.returncode == 1
    assert f'ERROR: {model}: entry jckpt/params/w: checksum mismatch' in p.stdout
    assert 'params/b' not in p.stdout  # only the bad entry is named
    assert 'FAILED' in p.stdout and '2 of 3 checksums verified, 1 error' in p.stdout
    data = json.loads(cli('verify', model, '--json').stdout)
    assert data['ok'] is False
    assert [(x['severity'], x['entry']) for x in data['problems']] == [('error', 'jckpt/params/w')]


def test_verify_truncated_and_garbage(model, tmp_path, cli):
    with open(model, 'r+b') as f:
        f.truncate(os.path.getsize(model) - 3)
    p = cli('verify', model)
    assert p.returncode == 1 and 'entry jckpt/step' in p.stdout and 'past the end' in p.stdout
    bad = tmp_path / 'bad.jckpt'
    bad.write_bytes(b'\xff\xff')
    p = cli('verify', bad)
    assert p.returncode == 1 and 'FAILED' in p.stdout and 'shorter than' in p.stdout


def test_verify_missing(tmp_path):
    one_line_error(jckpt_cmd('verify', tmp_path / 'gone.jckpt'), 'gone.jckpt', 'no such')


def test_verify_warnings_and_strict(tmp_path, cli):
    path = write(tmp_path / 'm.jckpt', ARRAYS)
    with open(path, 'ab') as f:
        f.write(b'trailing')
    p = cli('verify', path)
    assert p.returncode == 0 and 'WARNING' in p.stdout and '8 bytes follow the last payload' in p.stdout
    assert p.stdout.splitlines()[-1].startswith('OK: ')
    p = cli('verify', path, '--strict')  # it printed "OK" and exited 1
    assert p.returncode == 1 and p.stdout.splitlines()[-1].startswith('FAILED: ')
    assert p.stdout.rstrip().endswith('1 warning (--strict: warnings fail)')
    p = cli('verify', path, '--strict', '--json')  # it said "ok": true, and exited 1
    assert p.returncode == 1 and json.loads(p.stdout)['ok'] is False
    assert json.loads(cli('verify', path, '--json').stdout)['ok'] is True


def test_verify_manager_directory(tmp_path, cli):
    d = tmp_path / 'run'
    d.mkdir()
    paths = [_step_file(d, s, 1.0) for s in (1, 2)]
    assert cli('verify', d).returncode == 0
    corrupt_payload(paths[1], 'jckpt/w')
    p = cli('verify', d)
    assert p.returncode == 1 and f'{paths[1]}: entry jckpt/w: checksum mismatch' in p.stdout


def test_verify_and_inspect_a_step_of_another_format(tmp_path, cli):
    import jckpt
    with jckpt.CheckpointManager(tmp_path / 'run',
                                 options=jckpt.CheckpointOptions(format='npz')) as mgr:
        mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': {'mu': np.ones(2)}})
    step = tmp_path / 'run' / 'step_00000001.jckpt'
    p = cli('verify', step)
    assert p.returncode == 0 and '1 of 2 checksums verified' in p.stdout
    p = cli('inspect', step)
    assert p.returncode == 2 and 'one step of a checkpoint manager' in p.stderr


# --- diff --------------------------------------------------------------------

def test_diff(tmp_path, model, cli):
    same = write(tmp_path / 'same.jckpt', ARRAYS, alignment=64)
    p = cli('diff', model, same)
    assert p.returncode == 0, p.stdout + p.stderr
    assert 'SAME: 3 entries match' in p.stdout

    other = dict(ARRAYS)
    other['params/w'] = ARRAYS['params/w'] + np.float32(0.5)
    other['step'] = np.array(7, np.int64)
    del other['params/b']
    other['params/c'] = np.zeros(2, np.float32)
    b = write(tmp_path / 'b.jckpt', other)
    p = jckpt_cmd('diff', model, b)
    assert p.returncode == 1
    out = p.stdout
    assert f'only in {model}: jckpt/params/b' in out and f'only in {b}: jckpt/params/c' in out
    w = next(line for line in out.splitlines() if line.startswith('jckpt/params/w'))
    assert '12 of 12 values differ' in w and w.split()[-2:] == ['0.5', '1']  # max abs, max rel
    assert 'dtype int32 -> int64' in out
    assert 'DIFFERENT' in out

    data = json.loads(cli('diff', model, b, '--atol', '0.5', '--json').stdout)
    assert data['same'] is False  # still only-in entries and a dtype change
    entries = {e['name']: e for e in data['entries']}
    assert entries['jckpt/params/w']['same'] is True and entries['jckpt/params/w']['max_abs'] == 0.5


def test_diff_tolerances(tmp_path, cli):
    a = write(tmp_path / 'a.jckpt', {'x': np.array([1.0, 100.0], np.float32)})
    b = write(tmp_path / 'b.jckpt', {'x': np.array([1.0, 101.0], np.float32)})
    assert cli('diff', a, b).returncode == 1
    assert cli('diff', a, b, '--atol', '0.5').returncode == 1
    assert cli('diff', a, b, '--atol', '1').returncode == 0
    assert cli('diff', a, b, '--rtol', '0.01').returncode == 0    # 1 <= 0.01 * 101
    assert cli('diff', a, b, '--rtol', '0.005').returncode == 1
    p = cli('diff', a, b, '--atol', '-1')
    assert p.returncode == 2 and 'must be >= 0' in p.stderr and 'Traceback' not in p.stderr


def test_diff_missing_and_corrupt(tmp_path, model, cli):
    one_line_error(jckpt_cmd('diff', model, tmp_path / 'x.jckpt'), 'x.jckpt', 'no such')
    bad = tmp_path / 'bad.jckpt'
    bad.write_bytes(b'\x00\x00\x00\xff')
    one_line_error(cli('diff', bad, model), str(bad), 'extends past the end')


def test_diff_of_a_damaged_copy_is_an_error_unless_no_verify(tmp_path, cli):
    """A damaged copy within --atol of its source was SAME, exit 0."""
    x = np.linspace(0, 1, 64, dtype=np.float32)
    a, b = write(tmp_path / 'a.jckpt', {'x': x}), write(tmp_path / 'b.jckpt', {'x': x})
    data = bytearray(open(b, 'rb').read())
    data[-4] ^= 1                                      # the last value's lowest mantissa bit
    open(b, 'wb').write(data)
    one_line_error(cli('diff', a, b, '--atol', '1e-6'), str(b), 'jckpt/x', 'checksum mismatch')
    assert cli('diff', a, b, '--atol', '1e-6', '--no-verify').returncode == 0
    assert cli('diff', a, b, '--no-verify').returncode == 1


# --- convert -----------------------------------------------------------------

def test_convert_relayout(tmp_path, model, cli):
    dst = tmp_path / 'aligned.jckpt'
    p = jckpt_cmd('convert', model, dst, '--alignment', '4096')
    assert p.returncode == 0, p.stderr
    assert 'alignment 4096' in p.stdout
    data = json.loads(cli('inspect', dst, '--json').stdout)
    assert data['alignment'] == 4096 and data['data_start'] % 4096 == 0
    assert all(e['offset'] % 4096 == 0 for e in data['entries'])
    assert data['metadata']['note'] == 'hello'
    assert cli('diff', model, dst).returncode == 0
    assert cli('verify', dst).returncode == 0

    # an existing destination is kept unless --overwrite; the source can be rewritten in place
    before = dst.read_bytes()
    one_line_error(cli('convert', model, dst), str(dst), 'existing checkpoint')
    assert dst.read_bytes() == before
    assert cli('convert', model, dst, '--alignment', '64', '--overwrite').returncode == 0
    assert cli('convert', dst, dst, '--alignment', '128').returncode == 0
    assert json.loads(cli('inspect', dst, '--json').stdout)['alignment'] == 128


def test_convert_refuses_corrupt_and_missing(tmp_path, model, cli):
    corrupt_payload(model, 'jckpt/step')
    one_line_error(cli('convert', model, tmp_path / 'out.jckpt', '--alignment', '64'),
                   model, 'checksum mismatch', 'jckpt/step')
    assert not (tmp_path / 'out.jckpt').exists()
    one_line_error(cli('convert', tmp_path / 'none.jckpt', tmp_path / 'o.jckpt'), 'none.jckpt')


def test_convert_other_formats(tmp_path, model, cli):
    """Through the format adapters: to npz and back loses nothing; a foreign file is named."""
    npz = tmp_path / 'model.npz'
    p = jckpt_cmd('convert', model, npz)
    assert p.returncode == 0, p.stderr
    assert 'npz, converted from jckpt' in p.stdout
    back = tmp_path / 'back.jckpt'
    assert cli('convert', npz, back).returncode == 0
    assert cli('diff', model, back).returncode == 0
    shown = cli('inspect', npz)  # another format is listed as the converter reads it
    assert shown.returncode == 0 and 'npz checkpoint, 3 arrays' in shown.stdout, shown.stderr
    one_line_error(cli('verify', npz), 'npz format', 'jckpt convert')
    p = jckpt_cmd('convert', model, tmp_path / 'm2.npz')  # npz has no place for metadata
    assert p.returncode == 0 and p.stderr.startswith("jckpt: warning: ")
    assert "['note']" in p.stderr and len(p.stderr.strip().splitlines()) == 1  # no source line
    p = jckpt_cmd('convert', model, tmp_path / 'm.pt')  # .pt keeps it, and says nothing
    assert p.returncode == 0 and not p.stderr, p.stderr
    p = jckpt_cmd('convert', tmp_path / 'm.pt', tmp_path / 'm.jckpt')
    assert p.returncode == 0 and cli('inspect', tmp_path / 'm.jckpt', '--json').stdout.count('hello')
    one_line_error(cli('convert', model, tmp_path / 'x.npz', '--alignment', '64'), '--alignment')


def test_convert_nest_splits_a_state_dicts_dotted_names(tmp_path, cli):
    import jckpt
    from jckpt.adapters import torch as pt
    src = tmp_path / 'sd.pt'
    pt.write({'jckpt': {'dense.kernel': np.ones((2, 2), np.float32)}}, src, flat=False)
    out = tmp_path / 'sd.jckpt'
    assert cli('convert', src, out, '--nest').returncode == 0
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    assert list(tree['jckpt']['dense']) == ['kernel']
    flat = write(tmp_path / 'flat.jckpt', {'a.b': np.ones(1, np.float32)})
    assert cli('convert', flat, tmp_path / 'nested.jckpt', '--nest').returncode == 0
    _, tree = jckpt.load(jckpt.Context(host=True), tmp_path / 'nested.jckpt')
    assert list(tree['jckpt']['a']) == ['b']


# --- merge -------------------------------------------------------------------

def test_merge_with_prefixes(tmp_path, model, cli):
    student = write(tmp_path / 'student.jckpt', {'params/w': np.ones((2, 2), np.float32)})
    out = tmp_path / 'both.jckpt'
    p = jckpt_cmd('merge', out, model, student, '--prefix', 'teacher', '--prefix', 'student')
    assert p.returncode == 0, p.stderr
    assert 'student__jckpt, teacher__jckpt' in p.stdout
    data = json.loads(cli('inspect', out, '--json').stdout)
    names = [f"{e['namespace']}/{e['path']}" for e in data['entries']]
    assert names == ['teacher__jckpt/params/w', 'teacher__jckpt/params/b', 'teacher__jckpt/step',
                     'student__jckpt/params/w']
    assert data['metadata']['note'] == 'hello'
    assert cli('verify', out).returncode == 0
    # payloads were copied verbatim: the checksums are the inputs'
    src = {e['path']: e['checksum'] for e in json.loads(cli('inspect', model, '--json').stdout)['entries']}
    assert {e['path']: e['checksum'] for e in data['entries'][:3]} == src


def test_merge_refusals(tmp_path, model, cli):
    other = write(tmp_path / 'other.jckpt', {'params/w': np.ones(2, np.float32)})
    out = tmp_path / 'm.jckpt'
    one_line_error(cli('merge', out, model, other), 'jckpt/params/w', '--prefix')
    assert not out.exists()
    one_line_error(cli('merge', out, model, other, '--prefix', 'a'), '1 --prefix', '2 inputs')
    one_line_error(cli('merge', out, model, other, '--prefix', 'a', '--prefix', '9bad'),
                   "'9bad'")
    one_line_error(cli('merge', model, other), model, 'existing checkpoint')
    # appending to an existing file keeps its entries
    assert cli('merge', model, other, '--prefix', 'extra', '--append').returncode == 0
    names = {f"{e['namespace']}/{e['path']}"
             for e in json.loads(cli('inspect', model, '--json').stdout)['entries']}
    assert names == {'jckpt/params/w', 'jckpt/params/b', 'jckpt/step', 'extra__jckpt/params/w'}


def test_merge_overwrite_never_replaces_what_is_not_a_checkpoint(tmp_path, model, cli):
    """`jckpt merge notes.txt ... --overwrite` replaced the user's text file with the merge."""
    notes = tmp_path / 'notes.txt'
    notes.write_text('my notes')
    for extra in ((), ('--overwrite',), ('--append',)):
        p = cli('merge', notes, model, *extra)
        assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr
        assert 'merging would replace a file that is not a checkpoint (8 bytes)' in p.stderr
    assert notes.read_text() == 'my notes'


# --- usage, start-up, progress -------------------------------------------------

def test_usage_errors(cli):
    p = jckpt_cmd()
    assert p.returncode == 2 and 'usage: jckpt' in p.stderr
    p = cli('frobnicate')
    assert p.returncode == 2 and 'invalid choice' in p.stderr
    p = cli('--version')
    assert p.returncode == 0 and p.stdout.startswith('jckpt ')
    for bad in ('0', str(1 << 25), 'x'):
        p = cli('convert', 'a.jckpt', 'b.jckpt', '--alignment', bad)
        assert p.returncode == 2 and '--alignment' in p.stderr and 'Traceback' not in p.stderr


def test_read_commands_do_not_import_jax(model, tmp_path):
    merged = str(tmp_path / 'merged.jckpt')  # merge renames namespaces in the header alone
    code = ("import sys; from jckpt.tools.cli import main\n"
            f"for argv in (['inspect', {model!r}], ['verify', {model!r}], "
            f"['diff', {model!r}, {model!r}], "
            f"['merge', {merged!r}, {model!r}, {model!r}, '--prefix', 'a', '--prefix', 'b']):\n"
            "    assert main(argv) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=TIMEOUT, env=_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == '[]'


def test_inspect_and_verify_do_not_import_ml_dtypes(tmp_path):
    """Its import was most of these commands' time; they read precs by name and size."""
    import ml_dtypes

    path = write(tmp_path / 'bf16.jckpt', {'w': np.ones((2, 3), ml_dtypes.bfloat16)})
    code = ("import sys; from jckpt.tools.cli import main\n"
            f"assert main(['inspect', {path!r}]) == 0 and main(['verify', {path!r}]) == 0\n"
            "print('ml_dtypes' in sys.modules)\n")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       timeout=TIMEOUT, env=_env())
    assert p.returncode == 0, p.stderr
    assert 'bfloat16  (2, 3)' in p.stdout and p.stdout.strip().splitlines()[-1] == 'False'


def _run_under_pty(args, env):
    """Run with stderr on a pseudo-terminal; return (stdout, everything written to the pty)."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen([sys.executable, '-m', 'jckpt', *map(str, args)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                                env=env)
    finally:
        os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                seen += data
            elif proc.poll() is not None:
                break
        stdout = proc.communicate(timeout=TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, stdout.decode(), seen.decode('utf-8', 'replace')


def test_progress_bar_only_on_a_terminal(tmp_path):
    big = write(tmp_path / 'big.jckpt', {f'layer{i}/w': np.full((256, 1024), i, np.float32)
                                         for i in range(8)})
    tty_env = _env(CI=None, TERM='xterm-256color', COLUMNS='120')
    # in a pipe (stderr captured): no bar, nothing on stderr at all
    piped = subprocess.run([sys.executable, '-m', 'jckpt', 'verify', big], capture_output=True,
                           text=True, timeout=TIMEOUT, env=tty_env)
    assert piped.returncode == 0 and piped.stderr == ''
    # on a terminal: the bar is drawn on stderr, stdout is unchanged
    rc, stdout, terminal = _run_under_pty(['verify', big], tty_env)
    assert rc == 0
    assert stdout == piped.stdout
    assert 'verifying big.jckpt' in terminal
    assert '\x1b[' in terminal  # drawn with terminal control sequences
    # the bar can be turned off, and CI environments never get one
    assert 'verifying' not in _run_under_pty(['--no-progress', 'verify', big], tty_env)[2]
    assert 'verifying' not in _run_under_pty(['verify', big], _env(CI='true', TERM='xterm'))[2]


@pytest.mark.parametrize('buffered', [True, False])
def test_a_reader_gone_exits_141_quietly(model, buffered):
    """`jckpt inspect big.jckpt | head -1`: the reader closed before the output was written.
    Exit 1 (damage, differences) was wrong, and with stdout block-buffered (not a terminal)
    Python's flush at exit printed "Exception ignored ... BrokenPipeError" and exited 120."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # a reader that went away at once: every write fails with EPIPE
    try:
        p = subprocess.run([sys.executable, '-m', 'jckpt', 'inspect', model], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=TIMEOUT,
                           env=_env(PYTHONUNBUFFERED=None if buffered else '1'))
    finally:
        os.close(write_end)
    assert (p.returncode, p.stderr) == (141, '')


def test_convert_keeps_an_existing_destination_at_a_url(tmp_path, model, cli):
    """An existing object was replaced without --overwrite (the check looked on the local disk),
    and a URL source with an existing local destination failed with "No such file"."""
    import numpy as np

    import jckpt
    for dst in ('memory://cli-convert/keep.jckpt', 'memory://cli-convert/keep.npz'):
        jckpt.save(jckpt.Context(), {'keep': np.full(3, 7.0)}, dst)
        p = cli('convert', model, dst)
        assert p.returncode == 2 and 'would replace an existing checkpoint' in p.stderr
        assert jckpt.adapters.read(dst)['jckpt']['keep'].tolist() == [7.0] * 3
        assert cli('convert', model, dst, '--overwrite').returncode == 0
        assert 'keep' not in str(jckpt.adapters.read(dst))
    local = tmp_path / 'local.npz'
    np.savez(local, old=np.zeros(2))  # a checkpoint: --overwrite replaces it, not a file of text
    assert cli('convert', 'memory://cli-convert/keep.npz', local).returncode == 2
    p = cli('convert', 'memory://cli-convert/keep.npz', local, '--overwrite')
    assert p.returncode == 0, p.stderr


def test_convert_one_namespace(tmp_path, cli):
    import numpy as np

    import jckpt
    src = tmp_path / 'train.jckpt'
    jckpt.save(jckpt.Context(namespace='params'), {'w': np.ones(2, np.float32)}, src)
    jckpt.save(jckpt.Context(namespace='opt'), {'m': np.zeros(2, np.float32)}, src, appending=True)
    p = cli('convert', src, tmp_path / 'p.jckpt', '--namespace', 'params')
    assert p.returncode == 0, p.stderr
    assert [e.name for e in jckpt.describe(tmp_path / 'p.jckpt').tensors] == ['params/w']
    p = cli('convert', src, tmp_path / 'x.npz', '--namespace', 'nope')
    assert p.returncode == 2 and "no namespace 'nope'" in p.stderr


def test_consolidating_draws_a_bar_of_its_bytes(tmp_path):
    """It drew an empty bar of 0 bytes: consolidate took no progress."""
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(1 << 20, dtype=np.float32)}, processes=2)
    tty_env = _env(CI=None, TERM='xterm-256color', COLUMNS='120')
    rc, _, terminal = _run_under_pty(['convert', d, str(tmp_path / 'one.jckpt')], tty_env)
    assert rc == 0 and 'consolidating one.jckpt' in terminal and '4.2/4.2 MB' in terminal, terminal


# --- the page that documents the command line -----------------------------------

def _documented(text: str, flag: str) -> bool:
    return re.search(rf'(?<![\w-]){re.escape(flag)}(?![\w-])', text) is not None


def test_the_cli_page_documents_every_subcommand_and_flag():
    """docs/cli.md names each subcommand, and each flag in that command's row or section
    (it lacked verify's and diff's --json and merge's --alignment, --append, --overwrite and
    --no-verify); the options every command takes are named somewhere on the page."""
    from jckpt.tools.cli import build_parser

    text = Path(REPO, 'docs', 'cli.md').read_text()
    parser = build_parser()
    common = {o for a in parser._actions for o in a.option_strings} - {'-h', '--help'}
    assert [o for o in sorted(common) if not _documented(text, o)] == []
    sub, = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    undocumented = {}
    for name, command in sub.choices.items():
        row = [line for line in text.splitlines() if line.startswith(f'| `jckpt {name} ')]
        assert row, f'docs/cli.md has no row for `jckpt {name}`'
        assert f'\n## {name}\n' in text, f'docs/cli.md has no section for {name}'
        section = text.split(f'\n## {name}\n', 1)[1].split('\n## ', 1)[0]
        flags = {o for a in command._actions for o in a.option_strings if o.startswith('--')}
        missing = sorted(o for o in flags - common - {'--help'}
                         if not _documented(row[0] + section, o))
        if missing:
            undocumented[name] = missing
    assert undocumented == {}


def test_the_docs_name_only_subcommands_that_exist():
    """`jckpt info PATH` in docs/recipes.md and docs/object-storage.md named a command the
    parser does not have (`inspect` is; `jckpt.info` is the Python call)."""
    from jckpt.tools.cli import build_parser

    sub, = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    pages = [Path(REPO, 'README.md'), *sorted(Path(REPO, 'docs').glob('*.md'))]
    named = {(page.name, m.group(1)) for page in pages
             for m in re.finditer(r'(?:`|^\$ )jckpt ([a-z][a-z-]*)\b', page.read_text(), re.M)}
    assert sorted((page, word) for page, word in named if word not in sub.choices) == []


@pytest.mark.parametrize('command', ['inspect', 'diff'])
def test_help_names_every_kind_of_input_the_command_reads(cli, command):
    """inspect's help said "a checkpoint file or a checkpoint manager's directory", diff's
    "first checkpoint file": both also read multi-process directories and other formats."""
    r = cli(command, '--help')
    assert r.returncode == 0
    text = ' '.join(r.stdout.split())
    assert 'multi-process' in text and 'safetensors, .pt, npz, npy, llm.c, orbax' in text


@pytest.mark.parametrize('name', ['fifo.jckpt', 'fifo.safetensors', 'fifo.pt'])
def test_overwrite_never_replaces_a_fifo_or_a_device(model, tmp_path, cli, name):
    """`convert --overwrite` (and merge) renamed the new file over whatever was at DST:
    run as root onto /dev/null, it replaced the device with a checkpoint file."""
    import stat
    fifo = tmp_path / name
    os.mkfifo(fifo)
    for args in (('convert', model, fifo, '--overwrite'), ('merge', fifo, model, '--overwrite')):
        r = cli(*args)
        assert r.returncode == 2 and 'is a FIFO (named pipe): writing a checkpoint there would ' \
            'replace it' in r.stderr, (args, r)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(model), name])


def test_a_fifo_is_named_as_such_without_overwrite_too(model, tmp_path, cli):
    """Without --overwrite, convert and merge called a FIFO "an existing checkpoint"."""
    fifo = tmp_path / 'fifo.jckpt'
    os.mkfifo(fifo)
    for args in (('convert', model, fifo), ('merge', fifo, model)):
        one_line_error(cli(*args), str(fifo), 'is a FIFO (named pipe)')


def test_merge_never_replaces_what_is_not_a_checkpoint(tmp_path, model, cli):
    """`merge --overwrite` deleted a text file or a directory of other files at OUT, which
    `convert` refuses whatever its options."""
    notes = tmp_path / 'notes.jckpt'
    notes.write_text('my notes')
    folder = tmp_path / 'out.jckpt'
    folder.mkdir()
    (folder / 'a.txt').write_text('kept')
    for out, there in ((notes, 'a file that is not a checkpoint (8 bytes)'),
                       (folder, 'a directory holding 1 entry that is no part of a checkpoint')):
        for extra in ((), ('--overwrite',)):
            one_line_error(cli('merge', out, model, *extra),
                           f'merging would replace {there}', 'never deletes')
    assert notes.read_text() == 'my notes' and (folder / 'a.txt').read_text() == 'kept'
    assert cli('merge', tmp_path / 'm.jckpt', model).returncode == 0
    assert cli('merge', tmp_path / 'm.jckpt', model, '--overwrite').returncode == 0  # a checkpoint


def test_convert_of_no_checkpoint_says_what_inspect_says(tmp_path, cli):
    """convert said "in no format jckpt recognises (fix: pass format= one of ...)": the
    command line has no option naming the source's format (--format is the destination's)."""
    empty = tmp_path / 'empty'
    empty.mkdir()
    junk = tmp_path / 'junk.bin'
    junk.write_bytes(b'\x00\x00\x00\x05(((((' + bytes(100))
    for src in (empty, junk):
        r = cli('convert', src, tmp_path / 'out.safetensors')
        assert r.returncode == 2 and 'format=' not in r.stderr, r
        assert r.stderr == cli('inspect', src).stderr
    assert sorted(os.listdir(tmp_path)) == ['empty', 'junk.bin']


def test_convert_never_replaces_what_is_not_a_checkpoint(tmp_path, model, cli):
    """A text file or a directory of other files at the destination was called "an existing
    checkpoint", and `--overwrite` deleted it."""
    notes = tmp_path / 'notes.npz'
    notes.write_text('my notes')
    folder = tmp_path / 'out.jckpt'
    folder.mkdir()
    (folder / 'a.txt').write_text('kept')
    for dst, there in ((notes, 'a file that is not a checkpoint (8 bytes)'),
                       (folder, 'a directory holding 1 entry that is no part of a checkpoint')):
        for extra in ((), ('--overwrite',)):
            p = cli('convert', model, dst, *extra)
            assert p.returncode == 2 and f'converting would replace {there}' in p.stderr
            assert 'never deletes' in p.stderr
    assert notes.read_text() == 'my notes' and (folder / 'a.txt').read_text() == 'kept'
    assert cli('convert', model, tmp_path / 'm.npz').returncode == 0  # a checkpoint is replaced
    assert cli('convert', model, tmp_path / 'm.npz', '--overwrite').returncode == 0


def test_dash_as_an_output_is_refused_not_written_as_a_file_named_dash(tmp_path, model, cli,
                                                                      monkeypatch):
    """`jckpt convert a.jckpt -` wrote a file named `-`, where standard output was meant, which a
    checkpoint (written beside its path and renamed, read back mapped) cannot go to: every
    command that writes refuses it, naming `./-` for a file of that name."""
    monkeypatch.chdir(tmp_path)
    for args in (('convert', model, '-'), ('convert', model, '-', '--format', 'npz'),
                 ('merge', '-', model)):
        p = cli(*args)
        assert p.returncode == 2 and "'-' (standard output)" in p.stderr and './-' in p.stderr, p
        assert not os.path.exists('-')
    assert cli('convert', model, './-').returncode == 0 and os.path.isfile('-')
