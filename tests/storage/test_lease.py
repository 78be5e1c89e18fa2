"""``jckpt.storage.lease``: one writer of a path at a time, across threads and processes."""

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jckpt.errors import InUseError, StorageError
from jckpt.format.names import LEASE_SUFFIX
from jckpt.storage.lease import WriterLease, lease_path, refuse_if_held


def test_lease_path_of_a_file_and_of_a_directory(tmp_path):
    assert lease_path(tmp_path / 'm.jckpt') == str(tmp_path / 'm.jckpt') + LEASE_SUFFIX
    assert lease_path(str(tmp_path / 'new') + os.sep) == str(tmp_path / 'new') + LEASE_SUFFIX
    (tmp_path / 'ckpt').mkdir()
    assert lease_path(tmp_path / 'ckpt') == str(tmp_path / 'ckpt' / LEASE_SUFFIX)


def test_one_holder_and_the_second_is_told_who(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    lease = WriterLease(path)
    assert lease.held and repr(lease) == f"WriterLease({path!r}, held=True)"
    with open(lease_path(path)) as f:
        assert f.read() == f"{os.getpid()}\n"
    with pytest.raises(InUseError) as info:
        WriterLease(path)  # the same process is refused too, and told that it holds the lease
    assert str(info.value).startswith(f"{path}: in use: a writer of this process (pid "
                                      f"{os.getpid()}) holds the lease m.jckpt{LEASE_SUFFIX}: a "
                                      "Mirror or CheckpointManager opened on this path earlier")
    assert info.value.file == path and 'mgr.close()' in info.value.fix
    assert 'restart it' in info.value.fix  # one no variable refers to cannot be closed
    assert lease.held  # the refusal did not disturb the holder
    lease.release()


def test_a_holder_in_another_process_is_named_with_how_to_read_while_it_writes(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    with WriterLease(path):
        with open(lease_path(path), 'w') as f:  # as another process's lease records its pid
            f.write(f"{os.getpid() + 1}\n")
        with pytest.raises(InUseError) as info:
            WriterLease(path)
    assert str(info.value).startswith(f"{path}: in use: another writer (pid {os.getpid() + 1}) "
                                      f"holds the lease m.jckpt{LEASE_SUFFIX}")
    assert 'close the other mirror or manager' in info.value.fix
    # an evaluation job reading a live run is told how, not only to close the run
    assert 'jckpt.CheckpointManager(path, read_only=True)' in info.value.fix
    assert 'jckpt.restore the files jckpt.info(path) lists' in info.value.fix


def test_release_frees_the_path_and_is_idempotent(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    lease = WriterLease(path)
    lease.release()
    assert not lease.held and not os.path.exists(lease_path(path))
    lease.release()
    assert repr(lease).endswith('held=False)')
    WriterLease(path).release()  # free again


def test_context_manager_releases_also_on_an_exception(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    with WriterLease(path) as lease:
        assert lease.held
    assert not lease.held
    with pytest.raises(KeyError):
        with WriterLease(path) as lease:
            raise KeyError
    assert not lease.held and not os.path.exists(lease_path(path))


def test_a_dropped_lease_is_released(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    WriterLease(path)  # never released explicitly
    gc.collect()
    WriterLease(path).release()


def test_a_directory_is_leased_inside_it(tmp_path):
    (tmp_path / 'ckpt').mkdir()
    with WriterLease(tmp_path / 'ckpt'):
        assert os.path.exists(tmp_path / 'ckpt' / LEASE_SUFFIX)
        with pytest.raises(InUseError, match='in use'):
            WriterLease(tmp_path / 'ckpt')


def test_a_stale_lease_file_without_a_lock_is_free(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    with open(lease_path(path), 'w') as f:
        f.write('123456\n')  # a pid left by a writer that died
    with WriterLease(path):
        with open(lease_path(path)) as f:
            assert f.read() == f"{os.getpid()}\n"


HOLDER = textwrap.dedent("""
    import sys, time
    from jckpt.storage.lease import WriterLease
    lease = WriterLease(sys.argv[1])
    print('held', flush=True)
    time.sleep(60)
""")


def test_a_killed_holder_leaves_the_path_free(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, '-c', HOLDER, path], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        assert child.stdout.readline() == 'held\n'
        with pytest.raises(InUseError, match=rf'another writer \(pid {child.pid}\)'):
            WriterLease(path)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert os.path.exists(lease_path(path))  # the file stays; the kernel dropped its lock
    with WriterLease(path) as lease:
        assert lease.held


def test_a_planted_symlink_cannot_redirect_a_write(tmp_path):
    """A symlink at the writer-lease name must not let a mirror or manager truncate its target."""
    victim = tmp_path / 'victim'
    victim.write_bytes(b'precious')
    target = tmp_path / 'm.jckpt'
    os.symlink(victim, lease_path(str(target)))
    with pytest.raises(StorageError, match='symbolic link') as info:
        WriterLease(str(target))
    assert type(info.value) is StorageError and info.value.errno == errno.ELOOP
    assert info.value.file == lease_path(str(target))
    assert victim.read_bytes() == b'precious'


def test_a_missing_directory_is_a_storage_error(tmp_path):
    path = str(tmp_path / 'missing' / 'm.jckpt')
    with pytest.raises(StorageError, match='creating the writer lease failed') as info:
        WriterLease(path)
    assert info.value.errno == errno.ENOENT and info.value.file == lease_path(path)


def test_refuse_if_held_asks_other_leases_without_taking_them(tmp_path):
    mine, theirs = tmp_path / ".process00000", tmp_path / ".process00001"
    refuse_if_held([lease_path(theirs), str(tmp_path / "absent.jckpt-lease")], file=str(tmp_path))
    with WriterLease(theirs):
        with pytest.raises(InUseError, match=r"in use: another writer \(pid \d+\) holds the lease "
                                             r"\.process00001\.jckpt-lease") as e:
            refuse_if_held([lease_path(mine), lease_path(theirs)], file=str(tmp_path))
        assert "cannot share a directory" in e.value.fix
    refuse_if_held([lease_path(theirs)], file=str(tmp_path))  # released: free again
    with WriterLease(tmp_path):  # a whole directory's lease, as a single-process manager's
        with pytest.raises(InUseError):
            refuse_if_held([lease_path(tmp_path)], file=str(tmp_path))


def test_a_forked_childs_exit_leaves_the_parents_lease(tmp_path):
    """The child's release (its exit, or a writer it inherited closed there) unlinked the
    sidecar the parent holds its lock on: a second writer then locked a new file beside it."""
    path = tmp_path / 'run.jckpt'
    lease = WriterLease(path)
    pid = os.fork()
    if pid == 0:  # the child: drop its copy as its exit would
        try:
            lease.release()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.exists(lease_path(path)) and lease.held
    with pytest.raises(InUseError, match=f'pid {os.getpid()}'):
        WriterLease(path)
    lease.release()
    WriterLease(path).release()  # free once the parent lets go


@pytest.mark.parametrize("name", [LEASE_SUFFIX, ".process00001" + LEASE_SUFFIX])
def test_a_planted_fifo_is_refused_not_waited_on(tmp_path, name):
    """A FIFO at a lease's name blocked the writer opening it (forever: no one writes into it)
    or escaped as a bare OSError from the truncation; it is no lease, and is refused."""
    os.mkfifo(tmp_path / name)
    with pytest.raises(StorageError, match="not a regular file") as info:
        if name == LEASE_SUFFIX:
            WriterLease(tmp_path)
        else:
            refuse_if_held([str(tmp_path / name)], file=str(tmp_path))
    assert info.value.file == str(tmp_path / name)
