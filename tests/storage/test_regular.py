"""jckpt.storage.regular: every local reader opens through `open_regular`, which refuses
special files without blocking and names what they are."""

import os
import stat

import pytest

import jckpt
from jckpt.adapters import safetensors as st
from jckpt.storage.backend import LOCAL
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.regular import open_regular, special_name
from jckpt.tools.classify import classify


def test_a_regular_file_opens_for_reading(tmp_path):
    path = tmp_path / 'f.bin'
    path.write_bytes(b'abc')
    with open_regular(str(path)) as f:
        assert f.read() == b'abc' and os.get_blocking(f.fileno())


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_by_every_local_read_without_waiting_for_a_writer(tmp_path):
    """Opening a FIFO for reading blocks until someone writes: every local read asks first."""
    fifo = tmp_path / 'model.safetensors'
    os.mkfifo(fifo)
    reads = (open_regular, LOCAL.map, lambda p: LOCAL.head(p, 8), CheckpointReader,
             st.read_sharded, jckpt.adapters.read, classify)
    for read in reads:
        with pytest.raises(jckpt.FormatError, match='FIFO') as e:
            read(str(fifo))
        assert e.value.file == str(fifo) and e.value.fix


def test_a_device_and_a_link_to_one_are_named(tmp_path):
    link = tmp_path / 'zero.jckpt'
    os.symlink('/dev/zero', link)
    for path in ('/dev/null', str(link)):
        with pytest.raises(jckpt.FormatError, match='is a character device, not a regular file'):
            open_regular(path)


def test_a_socket_is_named(tmp_path, monkeypatch):
    """Linux refuses to open a socket at all (ENXIO); where a system opens it, fstat names it."""
    from jckpt.storage import regular
    path = tmp_path / 'f'
    path.write_bytes(b'x')
    real = os.fstat
    monkeypatch.setattr(regular.os, 'fstat', lambda fd: os.stat_result(
        (stat.S_IFSOCK | 0o600, *real(fd)[1:])))
    with pytest.raises(jckpt.FormatError, match='is a socket, not a regular file'):
        open_regular(str(path))


def test_a_directory_a_missing_file_and_a_refused_link_are_left_to_the_caller(tmp_path):
    """Each caller says what to pass instead; these stay OSErrors for it to translate."""
    with pytest.raises(IsADirectoryError):
        open_regular(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / 'missing'))
    real = tmp_path / 'real'
    real.write_bytes(b'x')
    os.symlink(real, tmp_path / 'link')
    with open_regular(str(tmp_path / 'link')) as f:
        assert f.read() == b'x'
    with pytest.raises(OSError, match='Too many levels of symbolic links'):
        open_regular(str(tmp_path / 'link'), follow_symlinks=False)


def test_no_descriptor_leaks_when_a_file_is_refused(tmp_path):
    before = len(os.listdir('/proc/self/fd'))
    for _ in range(20):
        with pytest.raises((jckpt.FormatError, IsADirectoryError)):
            open_regular('/dev/null')
        with pytest.raises(IsADirectoryError):
            open_regular(str(tmp_path))
    assert len(os.listdir('/proc/self/fd')) == before


@pytest.mark.parametrize('mode, name', [(stat.S_IFIFO, 'a FIFO (named pipe)'),
                                        (stat.S_IFCHR, 'a character device'),
                                        (stat.S_IFBLK, 'a block device'),
                                        (stat.S_IFSOCK, 'a socket'), (0, 'a special file')])
def test_special_name(mode, name):
    assert special_name(mode) == name


def test_a_socket_is_named_as_a_fifo_is(tmp_path):
    """Opening a socket fails with ENXIO, which was reported as "No such device or address"
    with the fix of an OS error, where info and verify said "is a socket"."""
    import socket
    path = str(tmp_path / 's')
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        with pytest.raises(jckpt.FormatError, match='is a socket, not a regular file') as e:
            open_regular(path)
        assert e.value.file == path and e.value.fix
