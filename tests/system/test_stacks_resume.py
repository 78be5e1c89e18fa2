"""An NNX training run killed with SIGKILL resumes where it stopped, bit for bit.

The run keeps what a real one needs besides its arrays: the model's batch
statistics and dropout stream, an optimizer that accumulates gradients over
two steps (`optax.MultiSteps`) with a schedule, a data-augmentation RNG
stream of its own (`nnx.Rngs`), and the data iterator's position
(`TrainerState.consumed_batches`). A child process trains, waits for a step
to be durable and kills itself; this process resumes from the directory and
must end where a run that was never killed ends.

Run as ``python tests/system/test_stacks_resume.py child DIR STEPS KILL_AT`` to be the child.
"""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import jckpt

CHILD_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


def batches(seed: int, start: int):
    """The data pipeline: batch `i` of the seed's stream, from `start` on (skipped as consumed)."""
    rng = np.random.default_rng(seed)
    for i in range(1 << 30):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        if i >= start:
            yield i, x, x.sum(1, keepdims=True)


def run(directory: str, steps: int, kill_at: int | None = None) -> list:
    """Train (resuming from `directory`'s latest step) to `steps`; the final leaves as lists."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(self.bn(self.l1(x))))

    def create():
        model = Model(nnx.Rngs(0, dropout=1))
        sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
        tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched)), 2)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Rngs(aug=42)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    model, optimizer, aug = create()
    with jckpt.CheckpointManager(directory, keep_last=2) as mgr:
        start, seed = 0, 7
        if mgr.latest_step() is not None:
            abstract = [nnx.state(a) for a in nnx.eval_shape(create)]
            r = mgr.restore(target=dict(zip(("model", "opt", "aug"), abstract)),
                            namespaces=["model", "opt", "aug"])
            for live, name in ((model, "model"), (optimizer, "opt"), (aug, "aug")):
                nnx.update(live, r.tree[name])
            start, seed = r.trainer_state.consumed_batches, r.trainer_state.user["data_seed"]
        data = batches(seed, start)
        for step in range(start, steps):
            i, x, y = next(data)
            x = x + 0.01 * np.asarray(jax.random.normal(aug.aug(), x.shape))
            train_step(model, optimizer, jnp.asarray(x), jnp.asarray(y))
            mgr.save(step + 1, items={"model": nnx.state(model), "opt": nnx.state(optimizer),
                                      "aug": nnx.state(aug)},
                     trainer_state=jckpt.TrainerState(global_step=step + 1, consumed_batches=i + 1,
                                                      user={"data_seed": seed}))
            if step + 1 == kill_at:
                mgr.wait_durable()
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait_durable()
    leaves = jax.tree.leaves((nnx.state(model), nnx.state(optimizer), nnx.state(aug)))
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                       else a) for a in leaves]


@pytest.mark.slow
def test_a_killed_nnx_run_resumes_bit_for_bit(tmp_path):
    pytest.importorskip("flax.nnx")
    pytest.importorskip("optax")
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "child",
                            str(tmp_path / "killed"), "6", "3"],
                           env=dict(os.environ, **CHILD_ENV), capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    with jckpt.CheckpointManager(tmp_path / "killed", read_only=True) as mgr:
        assert mgr.latest_step() == 3  # the resume starts there, not from scratch
        assert mgr.restore(namespaces=["aug"]).trainer_state.consumed_batches == 3
    resumed = run(str(tmp_path / "killed"), 6)
    never_killed = run(str(tmp_path / "whole"), 6)
    assert len(resumed) == len(never_killed)
    for a, b in zip(resumed, never_killed):
        assert a.tobytes() == b.tobytes()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "child":
    run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
