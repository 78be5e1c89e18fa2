"""Train a tiny GPT-2 in JAX with each checkpoint's model in llm.c's format, resume, check bit for bit.

The manager writes every checkpoint as a directory: ``model.bin`` (the
parameters as llm.c's ``train_gpt2`` reads them), ``optimizer.jckpt`` (the
Adam state) and ``trainer_state.json``, in the background while training goes
on. The run is interrupted, resumed from the last step (model from
``model.bin``, optimizer, trainer state) and compared with an uninterrupted
run. Runs on CPU with generated tokens (no download):

    python examples/train_gpt2_llmc.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jckpt
from jckpt.adapters import llmc

CONFIG = llmc.Config(max_seq_len=16, vocab_size=50, num_layers=2, num_heads=2, channels=32,
                     padded_vocab_size=64)


def init_params(key: jax.Array, config: llmc.Config = CONFIG) -> dict:
    """GPT-2 parameters in the layout of ``jckpt.adapters.llmc`` (weights are (out, in))."""
    params: dict = {'h': [{} for _ in range(config.num_layers)]}
    keys = iter(jax.random.split(key, 64))
    for (kind, shape), (_, where, per_layer) in zip(llmc.param_shapes(config), llmc.KINDS):
        for node in (params['h'] if per_layer else [params]):
            for name in where[:-1]:
                node = node.setdefault(name, {})
            if kind in ('ln1w', 'ln2w', 'lnfw'):
                node[where[-1]] = jnp.ones(shape, jnp.float32)
            elif len(shape) == 1:
                node[where[-1]] = jnp.zeros(shape, jnp.float32)
            else:
                node[where[-1]] = jax.random.normal(next(keys), shape, jnp.float32) * 0.02
    return params


def layer_norm(x, p):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p['weight'] + p['bias']


def dense(x, p):
    return x @ p['weight'].T + p['bias']


def forward(params: dict, tokens: jax.Array, config: llmc.Config = CONFIG) -> jax.Array:
    """Logits of a GPT-2 forward pass over ``tokens`` (batch, time)."""
    b, t = tokens.shape
    c, nh = config.channels, config.num_heads
    x = params['wte'][tokens] + params['wpe'][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params['h']:
        q, k, v = jnp.split(dense(layer_norm(x, layer['ln_1']), layer['attn']['c_attn']), 3, -1)
        q, k, v = (a.reshape(b, t, nh, c // nh).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(c // nh), -jnp.inf)
        y = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + dense(y, layer['attn']['c_proj'])
        h = jax.nn.gelu(dense(layer_norm(x, layer['ln_2']), layer['mlp']['c_fc']), approximate=True)
        x = x + dense(h, layer['mlp']['c_proj'])
    return layer_norm(x, params['ln_f']) @ params['wte'].T


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
    logits = forward(params, tokens[:, :-1])[..., :CONFIG.vocab_size]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


optimizer = optax.adam(1e-3)


@jax.jit
def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch(step: int) -> jax.Array:
    rng = np.random.default_rng(step)
    return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (4, CONFIG.max_seq_len + 1)), jnp.int32)


def model_tree(params: dict) -> dict:
    """What the manager writes as the model: the parameters and the dimensions llm.c's header needs."""
    config = {f.name: np.int32(getattr(CONFIG, f.name)) for f in dataclasses.fields(CONFIG)}
    return {**params, 'config': config}


def train(params, opt_state, start: int, until: int, manager=None, stop_at=None):
    for step in range(start + 1, until + 1):
        if stop_at is not None and step > stop_at:
            break
        params, opt_state, loss = train_step(params, opt_state, batch(step))
        if manager is not None:  # writes only every --every steps, in the background
            manager.save(step, items={'model': model_tree(params), 'opt': opt_state},
                         metrics={'loss': float(loss)},
                         trainer_state=jckpt.TrainerState(global_step=step, consumed_batches=step))
    return params, opt_state


def resume(manager, tmp: str, last: int, crash_at: int, params0: dict) -> tuple[dict, Any]:
    """The parameters and optimizer state of step ``last``, its model read from ``model.bin``."""
    step_dir = os.path.join(manager.directory, f'step_{last:08d}.jckpt')
    print(f"interrupted at step {crash_at}; last checkpoint: step {last}: "
          f"{sorted(os.listdir(step_dir))}")
    target = {'model': model_tree(params0), 'opt': optimizer.init(params0)}
    r = manager.restore(target=target, namespaces=['model', 'opt'])
    params = {k: v for k, v in r.tree['model'].items() if k != 'config'}
    print(f"resuming from step {r.trainer_state.global_step} (model read from model.bin)")
    jckpt.adapters.write({'jckpt': model_tree(params)}, os.path.join(tmp, 'converted.bin'),
                         format='llmc')
    with open(os.path.join(step_dir, 'model.bin'), 'rb') as a, \
            open(os.path.join(tmp, 'converted.bin'), 'rb') as b:
        print("model.bin is byte-identical to the llmc writer's file:", a.read() == b.read())
    return params, r.tree['opt']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--every', type=int, default=10)
    parser.add_argument('--crash-at', type=int, default=17)
    args = parser.parse_args()
    params0 = init_params(jax.random.key(0))
    reference, _ = train(params0, optimizer.init(params0), 0, args.steps)
    options = jckpt.CheckpointOptions(format='llmc')

    with tempfile.TemporaryDirectory() as tmp:
        ckpts = os.path.join(tmp, 'ckpts')
        manager = jckpt.CheckpointManager(ckpts, save_interval_steps=args.every, keep_last=2,
                                          options=options)
        train(params0, optimizer.init(params0), 0, args.steps, manager, stop_at=args.crash_at)
        manager.close()
        print(manager.counters)

        manager = jckpt.CheckpointManager(ckpts, save_interval_steps=args.every, keep_last=2,
                                          options=options)
        last = manager.latest_step()
        if last is None:  # interrupted before its first save: start again
            print(f"interrupted at step {args.crash_at}; no checkpoint yet: starting from step 0")
            params, opt_state, last = params0, optimizer.init(params0), 0
        else:
            params, opt_state = resume(manager, tmp, last, args.crash_at, params0)
        resumed, _ = train(params, opt_state, last, args.steps, manager)
        manager.close()
        print(manager.counters)

    same = all(np.array_equal(np.asarray(a), np.asarray(b)) and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed)))
    print("resumed run matches the uninterrupted run bit for bit:", same)
    if not same:
        raise SystemExit(1)


if __name__ == '__main__':
    main()
