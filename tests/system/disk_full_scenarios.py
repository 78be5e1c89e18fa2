"""A disk that really fills up: a save, an append and a mirror's drain on a small file system.

``tests/system/test_disk_full.py`` runs this module inside a private mount namespace
(``unshare``) with a size-limited tmpfs mounted at ``MOUNT``; each scenario fills the file
system until a few hundred KiB are left, writes something larger, and records what happened:
the error, its ``errno``, whether the previous checkpoint is byte for byte what it was, and
which staging files are left. It prints one line, ``RESULT {json}``.

    python -m tests.system.disk_full_scenarios MOUNT
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

#: What is left free before the larger write (it needs about 4 MiB): a page (the header
#: write fails) or 256 KiB (a payload write fails half way).
LEAVES = (4 << 10, 256 << 10)
FILLER = "filler.bin"


def fill(mount: str, leave: int) -> None:
    """Fill the file system at ``mount`` until about ``leave`` bytes are free."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(mount, FILLER), "wb") as f:
        try:
            f.write(bytes(max(0, free - leave)))
        except OSError:
            pass


def unfill(mount: str) -> None:
    os.remove(os.path.join(mount, FILLER))


def leftovers(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory)
                  if ".jckpt-stage" in n or ".jckpt-next" in n)


def _outcome(call) -> dict[str, Any]:
    from jckpt.errors import CheckpointError
    try:
        call()
    except CheckpointError as e:
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}
    return {"error": None}


def big() -> dict:
    return {"w": np.ones(1 << 20, np.float32)}  # 4 MiB


def scenario_save(mount: str, leave: int) -> dict:
    import jckpt
    d = os.path.join(mount, f"save-{leave}")
    os.mkdir(d)
    path = os.path.join(d, "model.jckpt")
    jckpt.save(jckpt.Context(), {"w": np.arange(1000, dtype=np.float32)}, path)
    before = open(path, "rb").read()
    fill(mount, leave)
    out = _outcome(lambda: jckpt.save(jckpt.Context(), big(), path))
    out.update(identical=open(path, "rb").read() == before, leftovers=leftovers(d))
    unfill(mount)
    return out


def scenario_append(mount: str, leave: int) -> dict:
    import jckpt
    d = os.path.join(mount, f"append-{leave}")
    os.mkdir(d)
    path = os.path.join(d, "model.jckpt")
    jckpt.save(jckpt.Context(), {"w": np.arange(1000, dtype=np.float32)}, path)
    before = open(path, "rb").read()
    fill(mount, leave)
    ctx = jckpt.Context(namespace="opt")
    out = _outcome(lambda: jckpt.save(ctx, big(), path, appending=True))
    out.update(identical=open(path, "rb").read() == before, leftovers=leftovers(d))
    unfill(mount)
    return out


def scenario_sharded(mount: str, leave: int) -> dict:
    """Columns sharded over 8 devices: short runs scattered through a mapping of the file
    (a store into a page the full disk cannot back was a SIGBUS that killed the process)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    d = os.path.join(mount, f"sharded-{leave}")
    os.mkdir(d)
    path = os.path.join(d, "model.jckpt")
    jckpt.save(jckpt.Context(), {"w": np.arange(1000, dtype=np.float32)}, path)
    before = open(path, "rb").read()
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("x",))
    w = jax.device_put(np.ones((1536, 1024), np.float32),  # 6 MiB: over ASSEMBLE_BYTES
                       NamedSharding(mesh, P(None, "x")))
    fill(mount, leave)
    out = _outcome(lambda: jckpt.save(jckpt.Context(), {"w": w}, path))
    out.update(identical=open(path, "rb").read() == before, leftovers=leftovers(d))
    unfill(mount)
    return out


def scenario_mirror(mount: str, leave: int) -> dict:
    import jckpt
    d = os.path.join(mount, f"mirror-{leave}")
    os.mkdir(d)
    path = os.path.join(d, "run.jckpt")
    m = jckpt.Mirror(path, retry_after=0.01, patience=3)
    m.submit({"w": np.arange(1000, dtype=np.float32)})
    assert m.wait_durable(timeout=60)
    before = open(path, "rb").read()
    fill(mount, leave)
    m.submit(big())
    out = _outcome(lambda: m.wait_durable(timeout=60))
    out.update(identical=open(path, "rb").read() == before, leftovers=leftovers(d))
    close = _outcome(m.close)
    out["close_error"] = close["error"]
    out.update(leftovers_after_close=leftovers(d),
               identical_after_close=open(path, "rb").read() == before)
    unfill(mount)
    return out


def main(mount: str) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before JAX starts
    results = {f"{name}-{leave}": fn(mount, leave) for leave in LEAVES for name, fn in (
        ("save", scenario_save), ("append", scenario_append), ("mirror", scenario_mirror),
        ("sharded", scenario_sharded))}
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
