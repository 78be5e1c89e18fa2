"""The writer lease of a URL: one holder at a time; a holder that is gone is taken over."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import jckpt
from jckpt.storage import backend_for, object_lease
from jckpt.storage.object_lease import ObjectLease
from jckpt.storage.object_store import ObjectURL, store_for

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")


def test_the_writer_lease_is_a_conditional_create(s3):
    backend = backend_for(s3)
    first = backend.lease(f"{s3}/m.jckpt")
    with pytest.raises(jckpt.InUseError, match="in use: another writer") as e:
        backend.lease(f"{s3}/m.jckpt")
    assert "delete" in e.value.fix and ".jckpt-lease" in e.value.fix
    first.release()
    backend.lease(f"{s3}/m.jckpt").release()


def plant(url, **holder):
    """A lease object as another writer would have left it."""
    import obstore

    u = ObjectURL.parse(url + ".jckpt-lease")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **holder}
    obstore.put(store_for(u), u.key, json.dumps(record).encode())


def dead_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)


def test_a_dead_holder_of_this_host_is_taken_over():
    url = "memory://leases/dead.jckpt"
    plant(url, pid=dead_pid())
    with ObjectLease(ObjectURL.parse(url)) as lease:
        assert lease.held


def test_a_live_holder_elsewhere_is_refused_until_it_goes_silent(monkeypatch):
    url = "memory://leases/elsewhere.jckpt"
    plant(url, host="another-host", pid=1)
    with pytest.raises(jckpt.InUseError, match="pid 1 on another-host"):
        ObjectLease(ObjectURL.parse(url))
    plant(url, host="another-host", pid=1, time=time.time() - object_lease.STALE_SECONDS - 1)
    ObjectLease(ObjectURL.parse(url)).release()


def test_the_holder_keeps_its_lease_fresh(monkeypatch):
    import obstore

    monkeypatch.setattr(object_lease, "REFRESH_SECONDS", 0.05)
    url = "memory://leases/fresh.jckpt"
    u = ObjectURL.parse(url + ".jckpt-lease")
    with ObjectLease(ObjectURL.parse(url)):
        first = json.loads(bytes(obstore.get(store_for(u), u.key).bytes()))["time"]
        time.sleep(0.3)
        assert json.loads(bytes(obstore.get(store_for(u), u.key).bytes()))["time"] > first
    assert backend_for("memory://leases").list("memory://leases") == []


def test_a_writer_whose_lease_was_taken_over_stops_writing(monkeypatch):
    """It went on saving and running retention beside the new holder: each deleted the
    other's steps."""
    import numpy as np
    monkeypatch.setattr(object_lease, "REFRESH_SECONDS", 0.05)
    url = "memory://leases/run"
    mgr = jckpt.CheckpointManager(url, keep_last=1, asynchronous=False)
    mgr.save(1, {"w": np.ones(2)})
    plant(url, host="another-host", pid=1)  # taken over, as by a writer that found it stale
    deadline = time.monotonic() + 10
    while mgr._lease._lost is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(jckpt.InUseError, match=r"taken over .* \(pid 1 on another-host\)") as e:
        mgr.save(2, {"w": np.ones(2)})
    assert e.value.file == url and "one writer per path" in e.value.fix
    with pytest.raises(jckpt.InUseError):
        mgr._stage(None)  # what the background writer would stage next is refused too
    mgr.close()
    assert backend_for(url).list(url) == ["step_00000001.jckpt"]
    assert json.loads(bytes(backend_for(url).map(url + ".jckpt-lease")))["host"] == "another-host"


def test_a_directory_step_manager_whose_lease_was_taken_over_stops_writing():
    """Directory steps (the default with several processes) bypassed the check: step 2 was
    written and retention deleted step 1 beside the new holder."""
    import numpy as np
    url = "memory://leases/dirsteps"
    mgr = jckpt.CheckpointManager(url, keep_last=1, asynchronous=False, directory_steps=True)
    mgr.save(1, {"w": np.ones(2)})
    mgr._lease._lost = "pid 1 on another-host"  # what the refresher records when it is taken
    with pytest.raises(jckpt.InUseError, match="taken over"):
        mgr.save(2, {"w": np.ones(2)})
    mgr.close()
    assert backend_for(url).list(url) == ["step_00000001.jckpt"]
