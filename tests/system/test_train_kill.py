"""SIGKILL a training process at random points; every restart resumes from the last durable step.

The parent starts one small training process per trial, kills it with
SIGKILL at a random moment (while it starts, restores, trains or writes),
then checks that the directory's latest step loads with valid checksums, is
at least the last step the child reported durable, and is the step the next
child resumes from. A final uninterrupted child finishes the run, and its
result must equal, bit for bit, a run that was never killed.

Run as ``python tests/system/test_train_kill.py child DIR STEPS`` to be the child.
"""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

CHILD_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


def child(directory: str, steps: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jckpt

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 1)) * 0.2}
        return {"params": params, "mom": jax.tree.map(jnp.zeros_like, params), "step": jnp.int32(0)}

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        mom = jax.tree.map(lambda m, d: 0.9 * m + d, state["mom"], g)
        params = jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], mom)
        return {"params": params, "mom": mom, "step": state["step"] + 1}, loss

    def batch(step):
        rng = np.random.default_rng(step)
        x = rng.normal(size=(16, 8)).astype(np.float32)
        return x, np.sin(x.sum(1, keepdims=True))

    mgr = jckpt.CheckpointManager(directory, keep_last=3, retry_after=0.05)
    start = mgr.latest_step()
    if start is None:
        start, state = 0, init()
    else:
        r = mgr.restore(target=init())
        state = r.tree
        assert r.trainer_state.global_step == int(state["step"]) == start
    print(f"resumed {start}", flush=True)
    train_step(state, *batch(0))  # compile before announcing readiness
    print("ready", flush=True)
    for step in range(start + 1, steps + 1):
        state, loss = train_step(state, *batch(step))
        mgr.save(step, state, metrics={"loss": float(loss)},
                 trainer_state=jckpt.TrainerState(global_step=step, consumed_batches=step))
        # Every save is one snapshot, so snapshot number k of this process is step start + k.
        if start + mgr.counters.durable:  # step 0 is never saved: "durable 0" would claim a file
            print(f"durable {start + mgr.counters.durable}", flush=True)
        time.sleep(0.001)
    mgr.close()
    print(f"durable {start + mgr.counters.durable}", flush=True)
    print("done", flush=True)


class Child:
    def __init__(self, directory, steps):
        env = dict(os.environ, **CHILD_ENV)
        self.err_path = f"{directory}.stderr"
        with open(self.err_path, "w") as err:  # a file, not a pipe: never blocks the child
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child",
                                          str(directory), str(steps)], stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env)
        self.lines = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.strip() == "ready":
                self.ready.set()
        self.ready.set()

    def finish(self, timeout=120):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self.reader.join(10)
        return self.proc.returncode

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.reader.join(10)

    @property
    def stderr(self):
        with open(self.err_path) as f:
            return f.read()

    def resumed(self):
        found = [int(m.group(1)) for line in self.lines if (m := re.fullmatch(r"resumed (\d+)", line))]
        return found[0] if found else None

    def last_durable(self):
        found = [int(m.group(1)) for line in self.lines if (m := re.fullmatch(r"durable (\d+)", line))]
        return max(found, default=None)


def latest_on_disk(directory):
    """The latest step file, checked to load with valid checksums (None if none)."""
    import jckpt

    steps = sorted(int(m.group(1)) for n in os.listdir(directory)
                   if (m := re.fullmatch(r"step_(\d{8})\.jckpt", n)))
    if not steps:
        return None
    path = os.path.join(directory, f"step_{steps[-1]:08d}.jckpt")
    _, tree = jckpt.load(jckpt.Context(host=True), path, mmap=False, verify=True)
    assert int(tree["jckpt"]["step"]) == steps[-1]
    return steps[-1]


def final_arrays(directory, step):
    import jckpt

    _, tree = jckpt.load(jckpt.Context(host=True), os.path.join(directory, f"step_{step:08d}.jckpt"),
                         mmap=False, verify=True)
    import jax

    return [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigkill_at_random_points_resumes_bit_for_bit(tmp_path):
    rng = random.Random(1234)
    run = tmp_path / "run"
    run.mkdir()
    never_ending = 10**7
    kills, prev_durable = 0, None
    for trial in range(22):
        expected = latest_on_disk(run)
        if prev_durable is not None:
            assert expected is not None and expected >= prev_durable, (trial, expected, prev_durable)
        c = Child(run, never_ending)
        if trial % 5 == 4:       # now and then, kill while the child starts or restores
            time.sleep(rng.uniform(0.0, 1.5))
        else:
            if not c.ready.wait(120):
                c.kill()
                pytest.fail(f"the child never got ready: {c.stderr}")
            time.sleep(rng.uniform(0.0, 0.4))
        c.kill()
        kills += 1
        if c.resumed() is not None:
            assert c.resumed() == (expected or 0), (trial, c.resumed(), expected)
        prev_durable = c.last_durable() if c.last_durable() is not None else prev_durable
        print(f"trial {trial}: resumed {c.resumed()} (on disk {expected}), last durable "
              f"{c.last_durable()}")
    assert kills >= 20
    last = latest_on_disk(run)
    assert last is not None and last >= (prev_durable or 0)

    total = last + 15
    c = Child(run, total)
    assert c.finish() == 0, c.stderr
    assert c.resumed() == last and c.lines[-1] == "done"
    # Nothing a killed writer left half done survives the next open.
    assert not [n for n in os.listdir(run) if ".jckpt-stage." in n or ".jckpt-next." in n]

    ref = tmp_path / "reference"
    r = Child(ref, total)
    assert r.finish() == 0, r.stderr
    assert r.resumed() == 0
    got, want = final_arrays(run, total), final_arrays(ref, total)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.tobytes() == b.tobytes(), k


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "child":
    child(sys.argv[2], int(sys.argv[3]))
