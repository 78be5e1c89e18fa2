"""Static check of the public API as a user calls it (``nox -s typecheck`` runs mypy on it).

Not a test module: mypy reads it with the library's signatures, so a change that breaks
the documented call patterns (argument names, return shapes) fails the type check.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jckpt
from jckpt import format as jformat


def public_api_round_trip(directory: str) -> None:
    path = os.path.join(directory, "ckpt.jckpt")
    ctx: jckpt.Context = jckpt.Context(namespace="model", durable=False)
    ctx = ctx.replace(alignment=64)
    tree: dict[str, Any] = {"w": jnp.ones((2, 3)), "b": np.zeros(3, np.float32), "step": 1}
    jckpt.save(ctx, tree, path, appending=False, alignment=None, metadata={"k": "v"})

    loaded_ctx: jckpt.Context
    loaded: dict[str, Any]
    loaded_ctx, loaded = jckpt.load(ctx, path, prefix_namespace=None, mmap=True, verify=False)
    registry: jckpt.Registry = loaded_ctx.registry
    top_id: int = registry.max_id("model")

    target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    restored: Any = jckpt.restore(ctx, target, path, mmap=None, cast=False, namespace="model")
    header: jformat.Header = jckpt.describe(path)
    entries: tuple[jformat.Entry, ...] = header.tensors
    meta: dict[str, str] = header.metadata_dict()
    counts: dict[str, int] = jckpt.ingestion_counts()
    renamed: dict[str, Any] = jckpt.prefix_namespace(loaded, "ema")
    del restored, entries, meta, counts, renamed, top_id

    try:
        jckpt.restore(ctx, {"missing": jnp.zeros(1)}, path)
    except jckpt.MissingEntryError as err:
        where: str | None = err.entry
        fix: str | None = err.fix
        del where, fix
    except jckpt.StorageError as err:
        code: int | None = err.errno
        del code


def services(directory: str) -> None:
    tree = {"w": np.ones(3, np.float32)}
    mirror_path = os.path.join(directory, "mirror.jckpt")
    with jckpt.Mirror(mirror_path, slots=2, when_full="block") as mirror:
        number: int = mirror.submit(tree, metadata={"step": "1"})
        durable: bool = mirror.wait_durable(timeout=60.0)
        counters: jckpt.MirrorCounters = mirror.counters
        del number, durable, counters

    trainer = jckpt.TrainerState(global_step=1, consumed_batches=1, learning_rate=1e-3)
    with jckpt.CheckpointManager(os.path.join(directory, "steps"), keep_last=2,
                                 best_metric="loss") as mgr:
        will_save: bool = mgr.save(1, tree, metrics={"loss": 0.5}, trainer_state=trainer)
        mgr.wait_durable()
        latest: int | None = mgr.latest_step()
        best: int | None = mgr.best_step()
        restored: jckpt.Restored = mgr.restore(target=tree)
        state: jckpt.TrainerState | None = restored.trainer_state
        del will_save, latest, best, state

    options = jckpt.CheckpointOptions(format="safetensors", model_writer=None,
                                      save_optimizer_state=True)
    load_options = jckpt.CheckpointLoadOptions(model_loader=None, load_optimizer_state=False)
    with jckpt.CheckpointManager(os.path.join(directory, "hf_steps"), options=options,
                                 load_options=load_options) as mgr:
        mgr.save(1, items={"model": {"w": jnp.ones(2)}, "opt": {"b": np.zeros(2, np.float32)}},
                 options=options)
        mgr.wait_durable()
        model_only: jckpt.Restored = mgr.restore(options=load_options)
        del model_only

    safetensors_path = os.path.join(directory, "w.safetensors")
    formats: tuple[str, str] = jckpt.convert(mirror_path, safetensors_path)
    detected: str = jckpt.detect_format(safetensors_path)
    ok: bool = jckpt.verify(mirror_path).ok
    table: str = repr(jckpt.info(mirror_path))
    del formats, detected, ok, table


def codec_round_trip() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    entry = jformat.Entry(id=0, namespace="jckpt", prec=jformat.prec_of(array.dtype),
                          dims=array.shape, offset=0, byte_length=array.nbytes)
    header = jformat.lay_out(jformat.Header(tensors=(entry,)))
    raw: bytes = jformat.encode_header(header)
    again: jformat.Header = jformat.decode_header(raw)
    offsets: tuple[int, ...] = jformat.plan_layout([array.nbytes], 32)
    del again, offsets


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        public_api_round_trip(d)
        services(d)
    codec_round_trip()
