"""A real full disk, not an injected ENOSPC: a save, an append, a sharded save (short runs
written through a mapping) and a mirror's drain on a small tmpfs fail with a StorageError
(errno ENOSPC), leave the previous checkpoint byte for byte as it was, and leave no staging
file.

The tmpfs is mounted in a private mount namespace (``unshare -m``, or ``unshare -rm`` as a
user namespace where the machine allows one), so nothing outside the test sees it; where the
machine allows neither, the test is skipped with the reason.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_on_small_tmpfs(mount) -> dict:
    """The scenarios' results, run on an 8 MiB tmpfs at ``mount``; skips when none can be had."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to make a private mount namespace for a small tmpfs")
    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    script = ('mount -t tmpfs -o size=8m jckpt-disk-full "$1" || exit 97; '
              'exec "$2" -m tests.system.disk_full_scenarios "$1"')
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([*prefix, "sh", "-c", script, "sh", str(mount), sys.executable],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        if proc.returncode == 97 or "unshare:" in proc.stderr:
            pytest.skip(f"cannot mount a size-limited tmpfs here: {proc.stderr.strip()[-300:]}")
        raise AssertionError(f"the scenarios died (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_a_full_disk_mid_save_mid_append_and_mid_drain(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    results = run_on_small_tmpfs(mount)
    # save, append, mirror and a sharded save of short runs, each at a page and 256 KiB left
    assert len(results) == 8
    for name, r in results.items():
        assert r["error"] == "StorageError" and r["errno"] == 28, (name, r)   # ENOSPC
        assert "No space left on device" in r["message"] and "free disk space" in r["message"]
        assert r["identical"], (name, "the previous checkpoint changed")
        assert r["leftovers"] == [], (name, r["leftovers"])
    for leave in (4096, 256 << 10):
        mirror = results[f"mirror-{leave}"]
        assert mirror["identical_after_close"] and mirror["leftovers_after_close"] == []
    assert not os.listdir(mount)  # the tmpfs was private to the scenarios' namespace
    record("disk_full", scenarios=len(results), enospc=len(results),
           previous_intact=sum(r["identical"] for r in results.values()),
           staging_left=sum(len(r["leftovers"]) for r in results.values()))
