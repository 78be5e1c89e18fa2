"""Train a small MLP, checkpoint every few steps, resume, and check bit-for-bit equality.

Checkpoints go through ``jckpt.CheckpointManager``: each save copies the state
to host memory and returns; a background writer publishes the step file
atomically and durably while training goes on. Runs on CPU with generated
data (no download):

    python examples/train_resume.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jckpt


def make_data(n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic regression task: y = sin(x @ w) + noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    w = rng.normal(size=(16, 1)).astype(np.float32)
    y = np.sin(x @ w) + 0.05 * rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def init_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {"dense1": {"w": jax.random.normal(k1, (16, 64)) * 0.25, "b": jnp.zeros(64)},
            "dense2": {"w": jax.random.normal(k2, (64, 1)) * 0.125, "b": jnp.zeros(1)}}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["dense1"]["w"] + params["dense1"]["b"])
    return jnp.mean((h @ params["dense2"]["w"] + params["dense2"]["b"] - y) ** 2)


optimizer = optax.adam(3e-3)


@jax.jit
def train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss


def batch(data, step: int, size: int = 64):
    x, y = data
    i = (step * size) % len(x)
    return x[i:i + size], y[i:i + size]


def initial_state() -> dict:
    params = init_params(jax.random.key(0))
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}


def train(state: dict, data, until: int, manager: jckpt.CheckpointManager | None = None,
          stop_at: int | None = None) -> dict:
    """Train to step ``until`` (or stop early at ``stop_at``), offering every step to ``manager``."""
    while int(state["step"]) < until:
        if stop_at is not None and int(state["step"]) >= stop_at:
            break
        state, loss = train_step(state, *batch(data, int(state["step"])))
        step = int(state["step"])
        if manager is not None:  # saves only on the manager's interval, in the background
            manager.save(step, state, metrics={"loss": float(loss)},
                         trainer_state=jckpt.TrainerState(global_step=step, consumed_batches=step,
                                                          learning_rate=3e-3))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=57)
    args = parser.parse_args()
    data = make_data()

    reference = train(initial_state(), data, args.steps)

    with tempfile.TemporaryDirectory() as tmp:
        ckpts = os.path.join(tmp, "ckpts")
        # The first run is interrupted at --crash-at; what it saved is durable once close returns.
        manager = jckpt.CheckpointManager(ckpts, save_interval_steps=args.every, keep_last=3)
        train(initial_state(), data, args.steps, manager, stop_at=args.crash_at)
        manager.close()
        print(manager.counters)

        manager = jckpt.CheckpointManager(ckpts, save_interval_steps=args.every, keep_last=3)
        print(f"interrupted at step {args.crash_at}; last checkpoint: step {manager.latest_step()}")
        if manager.latest_step() is None:  # interrupted before its first save: start again
            print("no checkpoint yet: starting from step 0")
            state = initial_state()
        else:
            restored = manager.restore(target=initial_state())
            state = restored.tree
            print(f"resuming from step {int(state['step'])} "
                  f"(trainer state: step {restored.trainer_state.global_step}, "
                  f"{restored.trainer_state.consumed_batches} batches consumed)")
        resumed = train(state, data, args.steps, manager)
        manager.close()
        print(manager.counters)
        print(f"steps kept: {manager.all_steps()}")

    same = all(np.array_equal(np.asarray(a), np.asarray(b)) and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed)))
    print(f"final loss {float(loss_fn(resumed['params'], *data)):.6f}")
    print("resumed run matches the uninterrupted run bit for bit:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
