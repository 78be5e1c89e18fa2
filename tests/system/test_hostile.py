"""Crafted hostile inputs, one per case: each is refused with a CheckpointError naming the file
(the command line: one line and exit 1 or 2) or handled correctly, never another exception."""

import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import jckpt
from jckpt.adapters import read
from jckpt.errors import CheckpointError, FormatError
from jckpt.format.names import INDEX_NAME
from tests.helpers import (
    entry_text,
    header_text,
    peak_bytes,
    raw_file,
    write_arrays,
    write_directory,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cli(capsys):
    """``jckpt ARGS`` in this process: ``(exit status, stdout, stderr)``."""
    from jckpt.tools.cli import main

    def run(*args):
        capsys.readouterr()
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        return rc, out, err
    return run


def refused(call, path, cls=CheckpointError, match=None):
    """``call()`` raises ``cls`` naming ``path``; its message."""
    with pytest.raises(cls, match=match) as info:
        call()
    assert str(path) in str(info.value)
    return str(info.value)


def cli_refuses(cli, *args):
    rc, _out, err = cli(*args)
    assert rc in (1, 2), err
    assert len(err.strip().splitlines()) == 1, err
    assert 'unexpected' not in err, err
    return err


def put(tmp_path, name, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def safetensors_bytes(header: str, data: bytes = b'') -> bytes:
    body = header.encode()
    return struct.pack('<Q', len(body)) + body + data


def npy_bytes(header: str, data: bytes = b'') -> bytes:
    body = header.encode('latin1')
    body += b' ' * (-(10 + len(body) + 1) % 64) + b'\n'
    return b'\x93NUMPY\x01\x00' + struct.pack('<H', len(body)) + body + data


def pth_bytes(pickle_ops: bytes) -> bytes:
    """A PyTorch zip archive whose data.pkl holds ``pickle_ops`` (protocol 2)."""
    import io
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w', zipfile.ZIP_STORED) as zf:
        zf.writestr('archive/data.pkl', b'\x80\x02' + pickle_ops + b'.')
        zf.writestr('archive/version', b'3\n')
    return out.getvalue()


def index_with(tmp_path, old: bytes, new: bytes) -> str:
    """A directory checkpoint whose index has ``old`` replaced by ``new``."""
    path = write_directory(tmp_path / 'd', {'a/b': np.zeros((4, 3), np.float32)})
    index = os.path.join(path, INDEX_NAME)
    raw = open(index, 'rb').read()
    assert old in raw
    text = raw[4:].rstrip().replace(old, new)
    with open(index, 'wb') as f:
        f.write(raw_file(text, align=32))
    return path


# --- 1. exceptions that are not CheckpointError -------------------------------------------------

def test_integer_of_5000_digits_in_a_header(tmp_path, cli):
    path = put(tmp_path, 'digits.jckpt', raw_file(header_text(entry_text(offset='1' * 5000)),
                                                  b'\0' * 4))
    refused(lambda: jckpt.info(path), path, FormatError, 'digits')
    refused(lambda: jckpt.load(jckpt.Context(), path), path, FormatError, 'digits')
    assert path in cli_refuses(cli, 'inspect', path)


def test_key_path_of_5000_components(tmp_path, cli):
    comps = ' '.join(['(k a)'] * 5000)
    path = put(tmp_path, 'deep.jckpt', raw_file(header_text(entry_text(
        extra=f' (path ({comps}))')), b'\0' * 4))
    refused(lambda: jckpt.load(jckpt.Context(), path), path, FormatError, 'components')
    assert path in cli_refuses(cli, 'inspect', path)


def test_writer_refuses_a_key_path_readers_would_refuse():
    from jckpt.format.entries import entry_for
    with pytest.raises(CheckpointError, match='deeper than'):
        entry_for('jckpt', (('k', 'a'),) * 1000, np.dtype('float32'), (1,), id=0)


def test_deeply_nested_json_in_metadata(tmp_path, cli):
    deep = '[' * 5000 + ']' * 5000
    path = write_arrays(tmp_path / 'meta.jckpt', {'a': np.zeros(2, np.float32)},
                        metadata={'x': deep, 'jckpt.metrics': deep, 'jckpt.trainer_state': deep})
    assert path in jckpt.info(path).render()
    assert repr(jckpt.info(path))
    rc, _out, err = cli('inspect', path)
    assert rc == 0, err


def test_directory_index_path_index_double_minus(tmp_path, cli):
    path = index_with(tmp_path, b'(path ((k a) (k b)))', b'(path ((k a) (i --5)))')
    refused(lambda: jckpt.load(jckpt.Context(), path), path, FormatError)
    refused(lambda: jckpt.info(path), path, FormatError)
    cli_refuses(cli, 'inspect', path)


@pytest.mark.parametrize('dims', [b'(0 1000000000000000000000000000000)', b'(' + b'1 ' * 70 + b')'])
def test_directory_index_shape_numpy_cannot_build(tmp_path, cli, dims):
    path = index_with(tmp_path, b'(global_dims (4 3))', b'(global_dims ' + dims + b')')
    refused(lambda: jckpt.load(jckpt.Context(), path), path, FormatError)
    cli_refuses(cli, 'inspect', path)


@pytest.mark.parametrize('shape', ['[0, 1000000000000000000000000000000]', '[' + '1, ' * 69 + '1]'])
def test_safetensors_shape_numpy_cannot_build(tmp_path, cli, shape):
    path = put(tmp_path, 'm.safetensors', safetensors_bytes(
        f'{{"w": {{"dtype": "F32", "shape": {shape}, "data_offsets": [0, 4]}}}}', b'\0' * 4))
    refused(lambda: read(path), path, FormatError, 'shape')
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


@pytest.mark.parametrize('header', [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 1000000000000000000000000000000), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (" + '1, ' * 70 + "), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (True, 2), }",
    "{'descr': '<U0', 'fortran_order': False, 'shape': (2,), }",
], ids=['huge-empty', '70-dims', 'bool-dim', 'U0'])
def test_npy_shape_or_dtype_numpy_cannot_build(tmp_path, cli, header):
    path = put(tmp_path, 'a.npy', npy_bytes(header, b'\0' * 8))
    refused(lambda: read(path), path, FormatError)
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


def test_pth_lists_nested_50000_deep(tmp_path, cli):
    n = 50_000
    path = put(tmp_path, 'deep.pth', pth_bytes(b']' * n + b'a' * (n - 1)))
    refused(lambda: read(path), path, FormatError)
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


def test_pth_list_containing_itself(tmp_path, cli):
    path = put(tmp_path, 'self.pth', pth_bytes(b']q\x00h\x00a'))
    refused(lambda: read(path), path, FormatError)
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


def test_pth_shared_sub_lists_expanding_to_2_39_leaves(tmp_path, cli):
    ops = b']K\x01aq\x00'  # l0 = [1]; then l(i) = [l(i-1), l(i-1)], 39 times
    for i in range(1, 40):
        ops += b'](h' + bytes([i - 1]) + b'h' + bytes([i - 1]) + b'eq' + bytes([i])
    path = put(tmp_path, 'bomb.pth', pth_bytes(ops))
    assert os.path.getsize(path) < 1000
    refused(lambda: read(path), path, FormatError, 'shared references')
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


def test_pth_dict_mixing_int_and_str_keys(tmp_path, cli):
    path = put(tmp_path, 'mixed.pth', pth_bytes(b'}K\x01K\x02sX\x01\x00\x00\x00aK\x03s'))
    refused(lambda: read(path), path, FormatError, 'keys')
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


@pytest.mark.parametrize('metrics', ['"abc"', 'null', '{"loss": "abc"}', '{"loss": null}',
                                     '[' * 5000 + ']' * 5000, '{"loss": ' + '[' * 5000 + ']' * 5000 + '}'],
                         ids=['string', 'null', 'string-value', 'null-value', 'deep', 'deep-value'])
def test_manager_metrics_that_are_not_numbers(tmp_path, cli, metrics):
    from jckpt.services.manager import CheckpointManager
    directory = tmp_path / 'run'
    directory.mkdir()
    write_arrays(directory / 'step_00000001.jckpt', {'a': np.zeros(2, np.float32)},
                 metadata={'jckpt.step': '1', 'jckpt.metrics': metrics})
    info = jckpt.info(directory)
    assert info.steps[0].metrics == {}
    assert str(directory) in info.render()
    rc, _out, err = cli('inspect', directory)
    assert rc == 0, err
    with CheckpointManager(directory, new_lineage=True) as manager:
        assert manager.all_steps() == [1]


# --- 2. reach ---------------------------------------------------------------------------------------

def one_tensor_safetensors(name: str = 'w') -> bytes:
    return safetensors_bytes(f'{{"{name}": {{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}}}',
                             b'\0' * 4)


def test_symlinked_model_safetensors_in_a_directory_is_refused(tmp_path, cli):
    victim = put(tmp_path, 'victim.safetensors', one_tensor_safetensors())
    directory = tmp_path / 'model'
    directory.mkdir()
    os.symlink(victim, directory / 'model.safetensors')
    refused(lambda: read(str(directory)), directory, FormatError, 'symbolic link')
    cli_refuses(cli, 'convert', directory, tmp_path / 'out.jckpt')
    assert not (tmp_path / 'out.jckpt').exists()


def test_symlinked_checkpoint_jckpt_in_an_orbax_item_is_refused(tmp_path, cli):
    victim = write_arrays(tmp_path / 'victim.jckpt', {'a': np.ones(2, np.float32)})
    item = tmp_path / 'item'
    item.mkdir()
    os.symlink(victim, item / 'checkpoint.jckpt')
    refused(lambda: read(str(item), format='orbax'), item, FormatError, 'symbolic link')
    cli_refuses(cli, 'convert', item, tmp_path / 'out.jckpt')


def test_converting_a_dotdot_key_to_npz_writes_no_unsafe_member(tmp_path, cli):
    src = put(tmp_path, 'evil.safetensors', one_tensor_safetensors('../../evil'))
    out = tmp_path / 'sub' / 'out.npz'
    out.parent.mkdir()
    refused(lambda: jckpt.convert(src, str(out)), out, CheckpointError, 'unsafe')
    assert cli_refuses(cli, 'convert', src, out)
    assert not out.exists() and not (tmp_path / 'evil.npy').exists()
    jckpt.convert(src, str(tmp_path / 'fine.jckpt'))  # other formats keep the name as it is


def test_inspect_prints_key_paths_escaped(tmp_path, cli):
    path = write_arrays(tmp_path / 'esc.jckpt', {'w\x1b[2J\x07\u202e': np.zeros(1, np.float32)},
                        metadata={'note': 'x\x1b]0;title\x07'})
    rc, out, err = cli('inspect', path)
    assert rc == 0, err
    assert '\x1b' not in out and '\x07' not in out and '\u202e' not in out
    assert '\\x1b[2J' in out
    assert '\x1b' not in jckpt.info(path).render()


# --- 3. memory --------------------------------------------------------------------------------------


def test_alignment_of_a_gigabyte_is_refused(tmp_path, cli):
    path = put(tmp_path, 'align.jckpt', raw_file(header_text(
        entry_text(), alignment='(alignment 1073741824)'), b'\0' * 4))
    refused(lambda: jckpt.info(path), path, FormatError, 'alignment')
    out = tmp_path / 'out.jckpt'
    cli_refuses(cli, 'convert', path, out)
    assert not out.exists()
    with pytest.raises(CheckpointError, match='alignment'):  # nor will the writer make one
        jckpt.Context(alignment=1 << 30)


def test_directory_index_with_huge_global_dims_allocates_nothing_up_front(tmp_path, cli):
    path = index_with(tmp_path, b'(global_dims (4 3))', b'(global_dims (8589934592 3))')
    index = os.path.join(path, INDEX_NAME)
    raw = open(index, 'rb').read()
    with open(index, 'wb') as f:
        f.write(raw_file(raw[4:].rstrip().replace(b'((2 4) (0 3))', b'((2 8589934592) (0 3))'),
                         align=32))
    assert peak_bytes(lambda: refused(lambda: jckpt.load(jckpt.Context(), path), path,
                                      FormatError, 'not in')) < 64 << 20
    assert peak_bytes(lambda: cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')) < 64 << 20
    assert not jckpt.verify(path).ok


def test_padded_entries_are_bounded_per_file_not_per_entry(tmp_path, cli):
    n = 400
    entries = [entry_text(id=i, dims='(1000 1000)', padding='(((0 999) (0 999)) 0.)',
                          offset=4 * i, length=4) for i in range(n)]
    path = put(tmp_path, 'padded.jckpt', raw_file(header_text(*entries), b'\0' * 4 * n))
    assert os.path.getsize(path) < 100_000
    peak = peak_bytes(lambda: refused(lambda: jckpt.load(jckpt.Context(), path), path,
                                      FormatError, 'padded'))
    assert peak < 64 << 20
    cli_refuses(cli, 'convert', path, tmp_path / 'out.npz')


# --- 4. the header checksum -------------------------------------------------------------------------

def flip_to_rename(path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (of the same length: a bit flip) in the file's header."""
    raw = bytearray(open(path, 'rb').read())
    (hlen,) = struct.unpack('>I', raw[:4])
    i = raw.index(old, 0, 4 + hlen)
    raw[i:i + len(old)] = new
    with open(path, 'wb') as f:
        f.write(raw)


def test_a_bit_flip_renaming_an_entry_is_caught_by_load_and_verify(tmp_path, cli):
    path = write_arrays(tmp_path / 'w.jckpt', {'wa': np.arange(3, dtype=np.float32),
                                               'wb': np.ones(2, np.float32)})
    flip_to_rename(path, b'(k wa)', b'(k wc)')  # 'a' ^ 0x02 == 'c': still parses, still unique
    assert b'(k wc)' in open(path, 'rb').read()
    refused(lambda: jckpt.load(jckpt.Context(host=True), path), path, FormatError,
            'header checksum mismatch')
    report = jckpt.verify(path)
    assert not report.ok and 'header checksum mismatch' in report.render()
    assert 'header checksum mismatch' in cli_refuses(cli, 'inspect', path)
    rc, out, _err = cli('verify', path)
    assert rc == 1 and 'header checksum mismatch' in out


@pytest.mark.parametrize('member', [INDEX_NAME, 'process_00001.jckpt'])
def test_a_bit_flip_in_a_directory_checkpoint_header_is_caught(tmp_path, member):
    path = write_directory(tmp_path / 'd', {'a/b': np.zeros((4, 3), np.float32)})
    flip_to_rename(os.path.join(path, member), b'(k b)', b'(k c)')
    refused(lambda: jckpt.load(jckpt.Context(host=True), path), member, FormatError,
            'header checksum mismatch')
    report = jckpt.verify(path)
    assert not report.ok and 'header checksum mismatch' in report.render()


def test_files_without_a_header_checksum_still_load(tmp_path):
    from jckpt.format import decode_header, encode_header
    path = write_arrays(tmp_path / 'old.jckpt', {'w': np.arange(3, dtype=np.float32)})
    raw = open(path, 'rb').read()
    (hlen,) = struct.unpack('>I', raw[:4])
    text = encode_header(decode_header(raw[:4 + hlen]), header_checksum=False)[4:].rstrip()
    assert b'header_checksum' not in text and len(text) < hlen
    with open(path, 'r+b') as f:  # the same header as an older writer wrote it
        f.write(raw[:4] + text.ljust(hlen))
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert tree['jckpt']['w'].tolist() == [0, 1, 2]
    assert jckpt.verify(path).ok


# --- 5. decompression and shared storages -----------------------------------------------------------

FIXTURES = os.path.join(os.path.dirname(__file__), '..', 'fixtures')


def zip_with(tmp_path, name: str, members: dict, method=zipfile.ZIP_DEFLATED) -> str:
    path = tmp_path / name
    with zipfile.ZipFile(path, 'w', method) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return str(path)


def npy_of(array: np.ndarray) -> bytes:
    import io
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.mark.parametrize('method', [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA],
                         ids=['deflate', 'bzip2', 'lzma'])
def test_compressed_npz_members_load(tmp_path, method):
    arrays = {'w': np.arange(1000, dtype=np.float32).reshape(10, 100), 'z': np.zeros(5, np.int64)}
    path = zip_with(tmp_path, 'c.npz', {f'{k}.npy': npy_of(v) for k, v in arrays.items()}, method)
    tree = read(path)['jckpt']
    for k, v in arrays.items():
        np.testing.assert_array_equal(tree[k], v)


def test_np_savez_compressed_of_zeros_loads(tmp_path):
    path = tmp_path / 'z.npz'
    np.savez_compressed(path, z=np.zeros(8 << 20, np.uint8))  # 8 MiB in about 8 KB: 1000 to 1
    assert os.path.getsize(path) < 16 << 10
    assert read(str(path))['jckpt']['z'].sum() == 0


def test_a_member_that_expands_past_its_npy_header_is_refused(tmp_path, cli):
    small = npy_of(np.zeros(4, np.float32))
    path = zip_with(tmp_path, 'b.npz', {'w.npy': small + bytes(64 << 20)})
    assert os.path.getsize(path) < 128 << 10
    peak = peak_bytes(lambda: refused(lambda: read(path), path, FormatError, 'more than'))
    assert peak < 16 << 20
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


@pytest.mark.parametrize('name', ['bomb_small_shape.npz', 'bomb_huge_shape.npz'])
def test_a_bzip2_bomb_in_an_npz_is_refused_in_bounded_memory(tmp_path, cli, name):
    path = os.path.join(FIXTURES, name)  # about 1 KB, 1 GiB of zeros (see make_bomb_fixtures.py)
    assert os.path.getsize(path) < 4096
    peak = peak_bytes(lambda: refused(lambda: read(path), path, FormatError,
                                      'decompress|past what'))
    assert peak < 32 << 20
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')
    assert not jckpt.verify(path).ok


def test_a_member_declaring_more_than_it_decompresses_to_is_refused(tmp_path):
    path = zip_with(tmp_path, 'short.npz', {'w.npy': npy_of(np.zeros(4, np.float32))})
    raw = bytearray(open(path, 'rb').read())
    central = raw.rindex(b'PK\x01\x02')
    struct.pack_into('<I', raw, central + 24, 1 << 20)  # uncompressed size: 1 MiB, not 144 B
    open(path, 'wb').write(raw)
    refused(lambda: read(path), path, FormatError)


def pth_of_views(storage: np.ndarray, names: list, extra: dict | None = None) -> bytes:
    """A torch.save archive whose data.pkl maps each name to a float32 tensor viewing all of
    one storage (persistent id loaded once, then reused from the memo)."""
    import io
    n = storage.size
    size = b'J' + struct.pack('<i', n) + b'\x85'
    ops = b'}q\x00('
    for i, name in enumerate(names):
        raw = name.encode()
        ops += b'X' + struct.pack('<I', len(raw)) + raw
        ops += b'ctorch._utils\n_rebuild_tensor_v2\n('
        if i == 0:
            ops += (b'(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000'
                    b'X\x03\x00\x00\x00cpu' + b'J' + struct.pack('<i', n) + b'tQq\x01')
        else:
            ops += b'h\x01'
        ops += b'K\x00' + size + b'K\x01\x85\x89ccollections\nOrderedDict\n)RtR'
    ops += b'u'
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w', zipfile.ZIP_STORED) as zf:
        zf.writestr('archive/data.pkl', b'\x80\x02' + ops + b'.')
        zf.writestr('archive/data/0', storage.astype('<f4').tobytes())
        zf.writestr('archive/byteorder', b'little')
        for member, data in (extra or {}).items():
            zf.writestr(member, data)
    return out.getvalue()


def test_tied_weights_in_a_pth_share_one_storage(tmp_path):
    storage = np.arange(16, dtype=np.float32)
    path = put(tmp_path, 'tied.pth', pth_of_views(storage, ['embed', 'lm_head']))
    tree = read(path)['jckpt']
    np.testing.assert_array_equal(tree['embed'], storage)
    assert np.shares_memory(tree['embed'], tree['lm_head'])  # one storage, not two copies


def test_a_pth_storage_viewed_1000_times_is_refused(tmp_path, cli):
    storage = np.zeros(64 << 10, np.float32)  # 256 KiB, viewed 1,000 times: 250 MiB of leaves
    path = put(tmp_path, 'views.pth', pth_of_views(storage, [f'w{i}' for i in range(1000)]))
    assert os.path.getsize(path) < 512 << 10
    peak = peak_bytes(lambda: refused(lambda: read(path), path, FormatError, 'viewed many times'))
    assert peak < 64 << 20
    out = tmp_path / 'out.jckpt'
    assert 'viewed many times' in cli_refuses(cli, 'convert', path, out)
    assert not out.exists()


# --- 6. verify never raises -------------------------------------------------------------------------

def _good(tmp_path) -> bytes:
    return open(write_arrays(tmp_path / 'good.jckpt', {'w': np.arange(8, dtype=np.float32)}),
                'rb').read()


VERIFY_INPUTS = {
    'missing': lambda t: str(t / 'gone.jckpt'),
    'dangling-symlink': lambda t: (os.symlink(t / 'nowhere', t / 'link.jckpt'), str(t / 'link.jckpt'))[1],
    'fifo': lambda t: (os.mkfifo(t / 'pipe.jckpt'), str(t / 'pipe.jckpt'))[1],
    'empty-directory': lambda t: (os.mkdir(t / 'empty'), str(t / 'empty'))[1],
    'empty-file': lambda t: put(t, 'empty.jckpt', b''),
    'garbage': lambda t: put(t, 'garbage.jckpt', os.urandom(4096)),
    'truncated': lambda t: put(t, 'cut.jckpt', _good(t)[:100]),
    'huge-header-length': lambda t: put(t, 'hlen.jckpt', b'\xff\xff\xff\xff((version 1)'),
    'header-of-zeros': lambda t: put(t, 'zeros.jckpt', b'\0\0\0\x10' + b'\0' * 16),
    'npz': lambda t: (np.savez(t / 'w.npz', w=np.ones(3)), str(t / 'w.npz'))[1],
    'safetensors': lambda t: put(t, 'm.safetensors', one_tensor_safetensors()),
    'pth': lambda t: put(t, 'm.pth', pth_bytes(b'}')),
    'bzip2-bomb': lambda t: os.path.join(FIXTURES, 'bomb_small_shape.npz'),
    'hostile-index': lambda t: index_with(t, b'(files (process_00000.jckpt',
                                          b'(files (../../etc/passwd'),
    'index-of-garbage': lambda t: (write_directory(t / 'd', {'a': np.zeros(4, np.float32)}),
                                   open(t / 'd' / INDEX_NAME, 'wb').write(os.urandom(300)),
                                   str(t / 'd'))[2],
    'unfinished-directory': lambda t: (write_directory(t / 'd', {'a': np.zeros(4, np.float32)}),
                                       os.remove(t / 'd' / INDEX_NAME), str(t / 'd'))[2],
    'manager-of-damaged-steps': lambda t: (os.mkdir(t / 'run'),
                                           put(t / 'run', 'step_00000001.jckpt', b'junk'),
                                           str(t / 'run'))[2],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize('kind', sorted(VERIFY_INPUTS))
def test_verify_returns_a_failed_report_for_every_input_and_never_raises(tmp_path, kind):
    path = VERIFY_INPUTS[kind](tmp_path)
    report = jckpt.verify(path)
    assert not report.ok and report.errors
    assert report.errors[0].message and report.render().startswith(('ERROR', 'WARNING'))
    assert 'FAILED' in report.render() and report.to_dict()['ok'] is False


@pytest.mark.parametrize('path', ['ftp://host/model.jckpt', 'a\0b.jckpt', 5], ids=['url', 'nul', 'int'])
def test_verify_of_an_argument_that_is_no_path_is_an_input_error(path):
    with pytest.raises(jckpt.InputError):  # a usage error, as every tool raises it
        jckpt.verify(path)


# --- 7. what the structure-aware fuzzer found ---------------------------------------------------------

def test_a_safetensors_dtype_that_is_not_a_string(tmp_path, cli):
    path = put(tmp_path, 'm.safetensors', safetensors_bytes(
        '{"w": {"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 4]}}', b'\0' * 4))
    refused(lambda: read(path), path, FormatError, 'not a string')
    cli_refuses(cli, 'convert', path, tmp_path / 'out.jckpt')


@pytest.mark.parametrize('record', [
    '{"a": ["jckpt", [["k", "x"], ["ki", 1]]], "b": ["jckpt", [["k", "x"], ["k", "y"]]]}',
    '{"a": ["jckpt", ' + json.dumps([["i", 0]] * 90000) + '], "b": ["jckpt", [["k", "b"]]]}',
], ids=['int-and-str-keys', '90000-components'])
def test_a_paths_record_no_tree_can_hold_reads_as_flat_names(tmp_path, record):
    import io
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w') as zf:
        zf.writestr('a.npy', npy_of(np.zeros(2, np.float32)))
        zf.writestr('b.npy', npy_of(np.ones(2, np.float32)))
        zf.comment = b'jckpt-paths:' + record.encode()
    path = put(tmp_path, 'r.npz', out.getvalue())
    tree = read(path)
    assert sorted(tree['jckpt']) == ['a', 'b']  # the record is ignored, as for np.savez files
    jckpt.convert(path, str(tmp_path / 'out.jckpt'))  # and the tree converts


def test_a_native_file_mixing_int_and_str_keys_is_refused(tmp_path):
    path = put(tmp_path, 'mixed.jckpt', raw_file(header_text(
        entry_text(id=0, extra=' (path ((ki 1)))'),
        entry_text(id=1, offset=4, extra=' (path ((k a)))')), b'\0' * 8))
    refused(lambda: jckpt.load(jckpt.Context(host=True), path), path, FormatError,
            'mixes integer and string keys')


def test_a_header_too_large_for_the_memory_left_is_a_format_error(tmp_path):
    """A 40 MB header off jckpt's layout (ten million atoms) read under an address-space cap:
    the reader ran out of memory counting its parentheses (8 bytes a byte of text) and the
    command line said "unexpected MemoryError"; now it is a FormatError naming the file."""
    atoms = ' '.join(['a'] * 10_000_000)
    text = header_text(entry_text(extra=f' (metadata_of_nothing ({atoms}))'))
    path = put(tmp_path, 'big.jckpt', raw_file(text, b'\0' * 4))
    code = (
        "import resource, sys\n"
        "import jckpt\n"
        "from jckpt.errors import CheckpointError\n"
        "vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    jckpt.info(sys.argv[1])\n"
        "    print('read')\n"
        "except CheckpointError as e:\n"
        "    print('refused', sys.argv[1] in str(e), e.message)\n"
        "except MemoryError as e:\n"
        "    print('MemoryError', e)\n")
    env = dict(os.environ, JAX_PLATFORMS='cpu', MALLOC_ARENA_MAX='2')
    out = subprocess.run([sys.executable, '-c', code, path], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert out.stdout.startswith(('refused True', 'read')), out.stdout + out.stderr[-2000:]
