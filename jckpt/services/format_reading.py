"""The reading side of the format layer: a step directory whose model is in another format.

`jckpt.services.formats` writes such a step (`model.<ext>`, `optimizer.jckpt`,
`trainer_state.json`); this module reads it back as `CheckpointManager.restore`
reads a jckpt step file: the model by the reader its first bytes pick (or
`CheckpointLoadOptions.model_loader`), filled into a target by `restore`'s own
rules, and `optimizer.jckpt` only when asked and present. The record
(`trainer_state.json`, checked by `jckpt.storage.step_directory.read_record`)
gives the step's metadata as a jckpt file's header would hold it:

>>> metadata_of({'step': 3, 'metadata': {}, 'metrics': {'loss': 0.5}})[METRICS_KEY]
'{"loss": 0.5}'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt import adapters, api
from jckpt.api import targets
from jckpt.api.context import Context
from jckpt.api.loading import Namespaces, namespace_names, restore_alone
from jckpt.errors import FormatError, InputError, MissingEntryError, TargetError
from jckpt.format import strict_json
from jckpt.format.entries import entry_for
from jckpt.format.names import METRICS_KEY, OPTIMIZER_NAME, STEP_KEY, TRAINER_STATE_KEY
from jckpt.services.formats import CheckpointLoadOptions, model_error
from jckpt.storage import step_directory
from jckpt.storage.backend import is_url
from jckpt.storage.checkpoint import open_checkpoint, reusing
from jckpt.storage.object_backend import NO_SUCH_OBJECT
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.trees import placement
from jckpt.trees import pytree as tree_mod


def read_metadata(path: str, step: int | None = None) -> dict[str, str]:
    """A step directory's metadata, as a jckpt step file's header would hold it."""
    return metadata_of(step_directory.read_record(path, step))


def metadata_of(record: Mapping[str, Any]) -> dict[str, str]:
    """The metadata of a step directory's record (`trainer_state.json`, checked by
    `step_directory.read_record`), as a jckpt step file's header would hold it."""
    meta = dict(record['metadata'])
    meta[METRICS_KEY] = strict_json.dumps(record.get('metrics', {}), sort_keys=True)
    if record.get('trainer_state') is not None:
        meta[TRAINER_STATE_KEY] = strict_json.dumps(record['trainer_state'], sort_keys=True)
    meta.setdefault(STEP_KEY, str(record.get('step', '')))
    return meta


def _read_model(file: str, record: Mapping[str, Any], options: CheckpointLoadOptions,
                step: int) -> Any:
    """The model subtree of a step, read by the reader its magic picks (or the loader).

    Without a loader the file is read once (from an object store, one GET: its format
    is detected from the bytes read, `adapters.holding`); a loader reads it itself, after
    its first bytes are looked at (is it a jckpt file?).
    """
    missing = FormatError(f"step {step} has no model file {record['model']}", file=file,
                          fix="the step is damaged: restore an earlier step")
    if not is_url(file) and not step_directory.is_file(file):  # a link is refused here
        raise missing
    if options.model_loader is not None:
        found = _detected(file, missing)
        if found != 'jckpt':
            try:
                return options.model_loader(file)
            except Exception as e:
                raise model_error(step, file, "reading the model with its loader", e) from e
        return _read_detected(file, found, step)
    try:
        buffer = adapters.map_file(file)
    except FormatError as e:
        if e.message != NO_SUCH_OBJECT:
            raise
        raise missing from None
    with adapters.holding(file, buffer):
        return _read_detected(file, _detected(file, missing), step)


def _detected(file: str, missing: FormatError) -> str | None:
    """The model file's format by its content (`None`: no known one); `missing` when there is
    no such object in the store."""
    try:
        return adapters.detect_format(file)
    except FormatError as e:
        if e.message == NO_SUCH_OBJECT:
            raise missing from None
        return None


def _read_detected(file: str, found: str | None, step: int) -> Any:
    """The model subtree of `file`, in the format `found` (which its name must not belie)."""
    named = adapters.format_for_destination(file)
    if found is None or (found != 'jckpt' and named is not None and found != named):
        raise FormatError(f"step {step}: the model file is {found or 'in no known format'}, "
                          f"not {named} as its name says", file=file,
                          fix="the step is damaged, or pass a model_loader for it")
    tree = adapters.read(file, format=found)
    return tree[next(iter(tree))] if len(tree) == 1 else tree


def _fill(ctx: Context, target: Any, model: Any, file: str, step: int, cast: bool,
          namespace: str) -> Any:
    """`target`'s structure filled from the model subtree read, by `restore`'s own rules
    (`jckpt.api.targets`: shapes, dtypes, weak types, PRNG keys), then placed. A model read
    as one bare array (an `.npy` file, which keeps no path) fills a target of one leaf."""
    stored = {}
    for p, array in tree_mod.flatten(model):
        stored[p] = stored[tree_mod.loose_path(p)] = np.asarray(array)
    items, treedef = tree_mod.flatten_with_treedef(target)
    if len(items) == 1 and set(stored) == {()}:
        stored = {items[0][0]: stored[()]}
    requests = []
    meshes: dict[Any, Any] = {}  # the target's abstract meshes, made concrete once each
    for p, leaf in items:
        where = tree_mod.leaf_name(namespace, p)
        array = stored.get(p, stored.get(tree_mod.loose_path(p)))
        if array is None:
            raise MissingEntryError(f"step {step}: the model has no leaf {where}", file=file,
                                    entry=where, fix="the target must have the saved model's structure")
        entry = entry_for(namespace, p, array.dtype, array.shape, id=0)
        try:
            requests.append(targets.take(ctx, entry, array, leaf, file, where, cast=cast,
                                         meshes=meshes))
        except TargetError as e:
            raise type(e)(f"step {step}: {e.message}", file=file, entry=where, fix=e.fix) from None
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=file)
    return jax.tree_util.tree_unflatten(treedef, values)


def _placed(ctx: Context, model: Any, file: str, namespace: str) -> Any:
    """The model subtree read without a target, its arrays placed as `load` places a jckpt
    step's (on `ctx.device`, or left on host with `ctx.host`); other leaves as read."""
    items, treedef = tree_mod.flatten_with_treedef(model)
    values = [leaf for _, leaf in items]
    arrays = [i for i, leaf in enumerate(values) if isinstance(leaf, np.ndarray)]
    requests = [(values[i], None, tree_mod.leaf_name(namespace, items[i][0]), None) for i in arrays]
    for i, value in zip(arrays, placement.place_all(requests, host=ctx.host, device=ctx.device,
                                                    file=file)):
        values[i] = value
    return jax.tree_util.tree_unflatten(treedef, values)


def load_step(ctx: Context, path: str, step: int, target: Any, *, namespaces: Namespaces | None,
              cast: bool, options: CheckpointLoadOptions, verify: bool = True,
              record: Mapping[str, Any] | None = None) -> Any:
    """Read a step directory as `CheckpointManager.restore` does for a step file.

    Without a target and namespaces: `{namespace: subtree}` of the model and
    (when loaded) the optimizer's namespaces. With a target alone: the
    `ctx.namespace` tree. With `namespaces`: `{namespace: subtree}` of those.
    `verify` checks the payloads of `optimizer.jckpt` (foreign model files carry no checksums).
    `record`: the step's record, when the caller has read it (`read_record`). From an object
    store, each file read is one GET (the record, the model, the optimizer's header and,
    past its first part, its payloads): no request asks what is there first.
    """
    record = record if record is not None else step_directory.read_record(path, step)
    model_ns, optimizer = record['model_namespace'], record.get('optimizer')
    if target is not None and namespaces is None and ctx.namespace != model_ns:
        namespaces = [ctx.namespace]  # the target is another namespace than the model's
        target = {ctx.namespace: target}
        return load_step(ctx, path, step, target, namespaces=namespaces, cast=cast,
                         options=options, verify=verify, record=record)[ctx.namespace]
    names = ([ctx.namespace] if target is not None and namespaces is None
             else None if namespaces is None else list(namespace_names(namespaces, path)))
    rest = [n for n in names or [] if n != model_ns]
    opt_file = os.path.join(path, OPTIMIZER_NAME)
    wanted = options.load_optimizer_state and optimizer is not None and (names is None or rest)
    reader = _optimizer_reader(opt_file) if wanted else None
    if rest and reader is None:
        raise MissingEntryError(f"step {step} has no namespace {rest[0]!r} to read (its "
                                f"optimizer state is {'not loaded' if optimizer else 'absent'})",
                                file=opt_file, fix="read the model's namespace "
                                f"{model_ns!r}, or pass load_optimizer_state=True")
    out: dict[str, Any] = {}
    with reusing(reader) if reader is not None else contextlib.nullcontext():
        if rest:
            _check_held(rest, record, opt_file, step)
        if names is None or model_ns in names:
            file = os.path.join(path, record['model'])
            model = _read_model(file, record, options, step)
            part = None if target is None else (target if namespaces is None else target[model_ns])
            out[model_ns] = (_placed(ctx, model, file, model_ns) if part is None
                             else _fill(ctx, part, model, file, step, cast, model_ns))
        if reader is not None:
            out.update(_load_optimizer(ctx, opt_file, target, rest if names else None, cast, verify))
    return out[model_ns] if target is not None and namespaces is None else out


def _optimizer_reader(file: str) -> Any:
    """The reader of a step's optimizer file, or `None` when the step lacks it (from an object
    store, the GET of its header, which a missing object fails; a local link is refused)."""
    if not is_url(file):
        return open_checkpoint(file) if step_directory.is_file(file) else None
    try:
        return open_checkpoint(file)
    except FormatError as e:
        if e.message != MISSING_OBJECT:
            raise
        return None


def _check_held(names: Sequence[str], record: Mapping[str, Any], opt_file: str, step: int) -> None:
    """Refuse namespaces neither the model nor the optimizer file holds, naming those it does."""
    held = sorted({e.namespace for e in api.describe(opt_file).tensors})
    missing = [n for n in names if n not in held]
    if missing:
        model_ns = record['model_namespace']
        raise MissingEntryError(
            f"step {step} has no namespace {missing[0]!r}: it holds {model_ns!r} (the model, "
            f"{record['model']}) and {held} ({OPTIMIZER_NAME})", file=os.path.dirname(opt_file),
            fix=f"restore the model with ctx=jckpt.Context(namespace={model_ns!r}), or name "
                "what to read with namespaces=[...]")


def _load_optimizer(ctx: Context, file: str, target: Any, names: Sequence[str] | None,
                    cast: bool, verify: bool) -> dict[str, Any]:
    if target is None:
        return api.load(ctx, file, namespaces=names or None, verify=verify)[1]
    if isinstance(target, Mapping) and names and set(names) <= set(target):
        return restore_alone(ctx, {n: target[n] for n in names}, file, cast=cast,
                             namespaces=names, verify=verify)
    raise InputError("with namespaces, the target must be {namespace: subtree}", file=file)


__all__ = ['load_step', 'metadata_of', 'read_metadata']
