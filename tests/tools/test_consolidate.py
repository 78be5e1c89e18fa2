"""One file from a directory checkpoint (jckpt.tools.consolidate): assembled from the pieces, checked."""

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jckpt
from jckpt.api.multiprocess import save_directory
from jckpt.errors import ChecksumError, FormatError, InputError
from jckpt.storage import CheckpointReader
from jckpt.tools.consolidate import consolidate
from jckpt.tools.verify import verify
from jckpt.version import __version__
from tests.helpers import corrupt_payload, cpu_mesh, write_arrays, write_directory


def identity(header):
    return [(e.name, e.id, e.prec, e.dims, e.key_impl, e.checksum) for e in header.tensors]


def payloads(reader):
    return {e.name: bytes(reader.payload_bytes(e)) for e in reader.header.tensors}


def test_an_8_device_sharded_save_consolidates_to_what_a_plain_save_writes(tmp_path):
    mesh = cpu_mesh((4, 2), ('data', 'model'))
    assert mesh.devices.size == 8

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    tree = {'w': put(np.arange(16 * 6, dtype=np.float32).reshape(16, 6), P('data', 'model')),
            'bf': put(np.arange(8 * 4).reshape(8, 4).astype(ml_dtypes.bfloat16), P('model', 'data')),
            'odd': put(np.arange(7 * 8, dtype=np.int32).reshape(7, 8), P(None, 'data')),
            'replicated': put(np.ones((3, 2), np.float16), P()),
            'key': jax.random.key(3), 'step': np.int64(12)}
    directory, one, plain = tmp_path / 'ckpt', tmp_path / 'one.jckpt', tmp_path / 'plain.jckpt'
    save_directory(jckpt.Context(), tree, directory, metadata={'step': '12'})
    jckpt.save(jckpt.Context(), tree, plain, metadata={'step': '12'})
    header = consolidate(directory, one)
    a, b = CheckpointReader(one), CheckpointReader(plain)
    assert identity(header) == identity(a.header) == identity(b.header)
    assert all(e.slice is None and e.global_dims is None for e in a.header.tensors)
    assert a.header.metadata == b.header.metadata == (('step', '12'),)
    assert a.header.alignment == b.header.alignment
    assert payloads(a) == payloads(b)
    assert a.verify() == []


def test_the_pieces_of_several_processes_are_assembled(tmp_path):
    arrays = {'w': np.arange(10 * 3, dtype=np.float32).reshape(10, 3),
              'v': np.arange(7, dtype=np.int16), 'c': np.arange(5, dtype=np.complex64) * 1j}
    d = write_directory(tmp_path / 'ckpt', arrays, processes=4, metadata={'note': 'x'})
    header = consolidate(d, tmp_path / 'one.jckpt', durable=False)
    assert header.writer == f'jckpt {__version__}' and dict(header.metadata) == {'note': 'x'}
    assert [(e.name, e.id, e.dims) for e in header.tensors] == [
        ('jckpt/w', 0, (10, 3)), ('jckpt/v', 1, (7,)), ('jckpt/c', 2, (5,))]
    reader = CheckpointReader(tmp_path / 'one.jckpt')
    for e in reader.header.tensors:
        np.testing.assert_array_equal(reader.decode(e), arrays[e.name.split('/')[1]])
    assert payloads(reader) == payloads(CheckpointReader(
        write_arrays(tmp_path / 'plain.jckpt', arrays)))
    assert verify(tmp_path / 'one.jckpt').ok


@pytest.mark.parametrize('alignment', [None, 1, 4096])
def test_alignment(tmp_path, alignment):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(12.0)}, processes=2)
    header = consolidate(d, tmp_path / 'one.jckpt', alignment=alignment, durable=False)
    assert header.alignment == (32 if alignment is None else alignment)  # default: the index's
    reader = CheckpointReader(tmp_path / 'one.jckpt')
    assert (reader.data_start + reader.header.tensors[0].offset) % header.alignment == 0
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0]), np.arange(12.0))


@pytest.mark.parametrize('alignment', [0, -5, True, 1 << 25, 2.0])
def test_an_alignment_no_reader_accepts_is_refused(tmp_path, alignment):
    """0 and -5 were written: a file describe refused and verify called damaged."""
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(12.0)}, processes=2)
    with pytest.raises(InputError, match='alignment must be a power of two') as e:
        consolidate(d, tmp_path / 'one.jckpt', alignment=alignment)
    assert e.value.file == str(tmp_path / 'one.jckpt') and e.value.fix
    assert not (tmp_path / 'one.jckpt').exists()


def test_a_damaged_piece_is_reported_and_nothing_written(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(8.0), 'b': np.ones(4)}, processes=2)
    piece = os.path.join(d, 'process_00001.jckpt')
    corrupt_payload(piece, 'jckpt/w')
    with pytest.raises(ChecksumError, match='checksum mismatch') as e:
        consolidate(d, tmp_path / 'one.jckpt')
    assert (e.value.file, e.value.entry) == (piece, 'jckpt/w')
    assert sorted(os.listdir(tmp_path)) == ['ckpt']  # no file, no staging file left
    consolidate(d, tmp_path / 'one.jckpt', verify=False, durable=False)  # taken as it is
    got = CheckpointReader(tmp_path / 'one.jckpt')
    assert not np.array_equal(got.decode(got.header.tensors[0]), np.arange(8.0))


def test_an_existing_file_is_replaced_atomically(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(4.0)}, processes=2)
    target = write_arrays(tmp_path / 'one.jckpt', {'old': np.zeros(1)})
    corrupt_payload(os.path.join(d, 'process_00000.jckpt'), 'jckpt/w')
    with pytest.raises(ChecksumError):
        consolidate(d, target)
    assert [e.name for e in CheckpointReader(target).header.tensors] == ['jckpt/old']  # intact


@pytest.mark.parametrize('what', ['missing', 'file', 'empty directory'])
def test_what_is_not_a_directory_checkpoint_is_refused(tmp_path, what):
    path = tmp_path / 'src'
    if what == 'file':
        write_arrays(path, {'w': np.ones(1)})
    elif what == 'empty directory':
        path.mkdir()
    with pytest.raises(FormatError, match='no index.jckpt') as e:
        consolidate(path, tmp_path / 'one.jckpt')
    assert e.value.file == str(path)
    assert not (tmp_path / 'one.jckpt').exists()


def test_what_is_not_a_checkpoint_is_never_replaced(tmp_path):
    """A text file at the destination was replaced without a word, which convert refuses."""
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(8.0)})
    notes = tmp_path / 'notes.jckpt'
    notes.write_text('my notes')
    with pytest.raises(InputError, match='consolidating would replace a file that is not a checkpoint') as e:
        consolidate(d, notes)
    assert e.value.file == str(notes) and notes.read_text() == 'my notes'
    done = tmp_path / 'done.jckpt'
    write_arrays(done, {'x': np.zeros(2)})
    consolidate(d, done)                               # a checkpoint is replaced
    assert [e.name for e in CheckpointReader(str(done)).header.tensors] == ['jckpt/w']
