"""The format layer of the checkpoint manager: a step whose model another toolchain reads directly.

A manager step is one jckpt file by default. With
`CheckpointOptions(format="llmc")` (or `"safetensors"`, `"torch"`/`"pth"`,
`"npz"`, any format added with `jckpt.register_format`) a step is a
directory instead:

```text
step_00000100.jckpt/
  model.bin            the model namespace, written by the format's writer
                       (or by CheckpointOptions.model_writer(tree, path))
  optimizer.jckpt      every other namespace (when save_optimizer_state)
  trainer_state.json   the TrainerState fields, the metrics and the metadata
```

The directory is staged under a temporary name next to the step, every file
and the directory are fsynced, and it is renamed into place whole, so a reader
sees the complete step or none of it. Restore peeks at the model file's first
bytes to pick the reader (a jckpt file named `model.bin` still reads as
jckpt), or calls `CheckpointLoadOptions.model_loader(path)`, and reads
`optimizer.jckpt` only when asked and present.

Which namespace is the model: with `mgr.save(step, tree)` the whole tree is
the model (and there is no optimizer file); with `mgr.save(step,
items={...})` it is `items[options.model_namespace]` (`"model"` by
default) and every other item goes to `optimizer.jckpt`.

>>> CheckpointOptions(format="llmc").model_file
'model.bin'
>>> CheckpointOptions(format="pth").format, CheckpointOptions(format="pth").model_file
('torch', 'model.pth')
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt import adapters, api
from jckpt.api import targets
from jckpt.api.context import Context
from jckpt.api.loading import Namespaces, namespace_names
from jckpt.errors import (
    CheckpointError,
    FormatError,
    InputError,
    MissingEntryError,
    StorageError,
    TargetError,
)
from jckpt.format.entries import entry_for
from jckpt.format.names import (
    METRICS_KEY,
    MODEL_STEM,
    OPTIMIZER_NAME,
    STEP_KEY,
    TRAINER_STATE_KEY,
    TRAINER_STATE_NAME,
)
from jckpt.services.snapshot import SnapshotLeaf
from jckpt.storage import staging, step_directory
from jckpt.storage.backend import is_url
from jckpt.storage.checkpoint import open_checkpoint, reusing
from jckpt.storage.object_backend import NO_SUCH_OBJECT
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.publish import storage_error
from jckpt.trees import placement
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import unflatten

#: Names that choose a registered format under another name.
_ALIASES = {'pth': 'torch'}
#: The model file's extension where the format's first one is not the usual one.
_EXTENSIONS = {'torch': '.pth'}
#: Registered formats whose writer makes a directory: a step's model is one file.
_DIRECTORY_FORMATS = frozenset({'orbax'})


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How `CheckpointManager` writes a step.

    Attributes:
      format: `"jckpt"` (one jckpt file per step, the default) or a
        registered format's name (`"llmc"`, `"safetensors"`, `"torch"` or
        `"pth"`, `"npz"`, ...): the step is then a directory whose model is in
        that format.
      model_writer: `model_writer(tree, path)` writes the model subtree (host
        numpy arrays) to `path` instead of the format's registered writer.
        A failed write is retried, like a full disk, except an
        `jckpt.InputError` (raised by a format's writer for a tree it cannot
        hold, or by the callback): that step is dropped and the next `wait`
        raises it, so that later steps are still written.
      save_optimizer_state: write the namespaces other than the model
        (`optimizer.jckpt`); `False` keeps only the model and the trainer state.
      model_namespace: which item of `save(items=...)` is the model.
    """

    format: str = 'jckpt'
    model_writer: Callable[[Any, str], None] | None = None
    save_optimizer_state: bool = True
    model_namespace: str = 'model'

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or not self.format:
            raise InputError(f"format must be a format's name, not {self.format!r}")
        name = _ALIASES.get(self.format, self.format)
        object.__setattr__(self, 'format', name)
        if self.model_writer is not None and not callable(self.model_writer):
            raise InputError("model_writer must be callable as model_writer(tree, path)")
        if name == 'jckpt' and self.model_writer is not None:
            raise InputError("model_writer needs a foreign format",
                             fix='pass format= the model file\'s format, e.g. "llmc"')
        if not isinstance(self.save_optimizer_state, bool):
            raise InputError("save_optimizer_state must be True or False")
        Context(namespace=self.model_namespace)  # validates the name
        if name in _DIRECTORY_FORMATS and self.model_writer is None:
            raise InputError(f"format {name!r} writes a directory, and a step's model is one file",
                             fix="pick a one-file format (llmc, safetensors, pth, npz), or save "
                                 "through jckpt.adapters.orbax_handler inside orbax's manager")
        if name != 'jckpt' and self.model_writer is None:
            fmt = adapters.get_format(name)
            if fmt.write is None:
                raise InputError(f"format {name!r} cannot be written, only read",
                                 fix="pass model_writer=, or another format")

    @property
    def foreign(self) -> bool:
        """Whether a step is a directory with the model in another format."""
        return self.format != 'jckpt'

    @property
    def model_file(self) -> str:
        """The model file's name in a step directory (`model.bin` for llm.c)."""
        known = adapters.formats().get(self.format)
        ext = _EXTENSIONS.get(self.format) or (known.extensions[0] if known and known.extensions
                                               else f".{self.format}")
        return MODEL_STEM + ext


@dataclasses.dataclass(frozen=True)
class CheckpointLoadOptions:
    """How `restore` reads a step directory.

    Attributes:
      model_loader: `model_loader(path) -> tree` reads the model file instead of
        the reader its magic picks (a jckpt file still reads as jckpt); the tree
        is the model subtree, with the structure it was saved with.
      load_optimizer_state: read `optimizer.jckpt` too, when the step has one.
    """

    model_loader: Callable[[str], Any] | None = None
    load_optimizer_state: bool = True

    def __post_init__(self) -> None:
        if self.model_loader is not None and not callable(self.model_loader):
            raise InputError("model_loader must be callable as model_loader(path) -> tree")
        if not isinstance(self.load_optimizer_state, bool):
            raise InputError("load_optimizer_state must be True or False")


def is_step_directory(path: str) -> bool:
    """Whether `path` is a published step directory of the format layer."""
    return step_directory.is_published(path, TRAINER_STATE_NAME)


# --- writing -------------------------------------------------------------------------------------

def _fail(step: int, file: str, what: str, e: BaseException) -> CheckpointError:
    """The error of a failed model write, naming the step and the published `file`.

    A `StorageError` (or an `OSError`) stays one, and the pipeline retries it; a
    writer's `CheckpointError` keeps its class, message, entry and fix, so an `InputError`
    (a tree the format cannot hold) drops the step instead of retrying it forever;
    what a `model_writer` raises for a fault of its own, which another attempt repeats
    (a `TypeError`, `ValueError`, `KeyError`, ...: `_CALLBACK_FAULTS`), is an `InputError`
    and drops the step too; anything else it raises is a `CheckpointError`, retried.
    """
    if isinstance(e, StorageError):  # keeps its errno for the counters
        return e
    if isinstance(e, OSError):
        return storage_error(e, what, file)
    if isinstance(e, CheckpointError) and type(e).__init__ is CheckpointError.__init__:
        return type(e)(f"step {step}: {what}: {e.message}", file=file, entry=e.entry,
                       fix=e.fix or _WRITER_FIX)
    if isinstance(e, CheckpointError):
        return e
    fault = InputError if isinstance(e, _CALLBACK_FAULTS) else CheckpointError
    return fault(f"step {step}: {what}: {e}", file=file, fix=_WRITER_FIX)


#: What a callback raises for a fault of its own (not of the disk or the network).
_CALLBACK_FAULTS = (TypeError, ValueError, KeyError, IndexError, AttributeError,
                    NotImplementedError, AssertionError)


_WRITER_FIX = "check the model tree and the format's writer or callback"


def check_model(options: CheckpointOptions, trees: Mapping[str, Any], namespace: str, step: int,
                target: str) -> None:
    """Refuse, when the step is saved, a model its format's writer cannot hold (from shapes and
    dtypes, `Format.check`); one that passes can still fail when written, and is dropped then.

    A model of the structure, shapes and dtypes of one that passed is not checked again: the
    check runs on the training loop's time, and a run saves one such model step after step.
    """
    if not options.foreign or options.model_writer is not None:
        return
    check = adapters.get_format(options.format).check
    if check is None:
        return
    leaves, treedef = jax.tree_util.tree_flatten(trees[namespace])
    seen = (check, namespace, treedef, tuple((getattr(x, 'dtype', type(x)), getattr(x, 'shape', ()))
                                             for x in leaves))
    if seen in _PASSED:
        return
    named = os.path.join(target, options.model_file)
    try:
        check({namespace: trees[namespace]}, named)
    except InputError as e:
        raise InputError(f"step {step}: the model cannot be written as {options.format}: "
                         f"{e.message}", file=named, entry=e.entry, fix=e.fix) from None
    if len(_PASSED) >= 16:
        _PASSED.clear()
    _PASSED.add(seen)


#: The models (check, namespace, structure, dtypes and shapes) that passed `check_model`.
_PASSED: set[tuple] = set()


def _write_model(options: CheckpointOptions, model: Any, namespace: str, path: str,
                 step: int, named: str) -> None:
    """Write the model to `path`; errors name the step and `named`, the file once published."""
    try:
        if options.model_writer is not None:
            options.model_writer(model, path)
        else:
            adapters.write({namespace: model}, path, format=options.format)
    except Exception as e:
        raise _fail(step, named, f"writing the model as {options.format}", e) from e
    if not step_directory.is_file(path):
        raise CheckpointError(f"step {step}: the model writer wrote no file", file=named,
                              fix="model_writer(tree, path) must write the file at path")


def step_record(step: int, options: CheckpointOptions, namespace: str, optimizer: bool,
                metadata: Mapping[str, str]) -> dict[str, Any]:
    """What `trainer_state.json` holds: readable fields, and the metadata to rebuild the header's."""
    rest = {k: v for k, v in metadata.items() if k not in (METRICS_KEY, TRAINER_STATE_KEY)}
    state = metadata.get(TRAINER_STATE_KEY)
    return {'step': step, 'model': options.model_file, 'model_format': options.format,
            'model_namespace': namespace, 'optimizer': OPTIMIZER_NAME if optimizer else None,
            'trainer_state': None if state is None else json.loads(state),
            'metrics': json.loads(metadata.get(METRICS_KEY, '{}')), 'metadata': rest}


def stage_step(temporary: str, target: str, step: int, items: Sequence[SnapshotLeaf], built: tuple, *,
               options: CheckpointOptions, namespace: str, metadata: Mapping[str, str],
               alignment: int) -> None:
    """Write a step directory under `temporary` (not yet durable): model, optimizer, trainer state.

    `items`/`built` are the snapshot's host leaves and their entries and
    sources; `namespace` is the model's. A failure leaves no staged directory.
    """
    step_directory.make_staged(temporary)  # what an earlier attempt of this job left is removed
    try:
        model = unflatten([(leaf.path, leaf.array) for leaf in items
                                    if leaf.namespace == namespace])
        _write_model(options, model, namespace, os.path.join(temporary, options.model_file), step,
                     os.path.join(target, options.model_file))
        entries, sources = built
        rest = [i for i, e in enumerate(entries) if e.namespace != namespace]
        optimizer = bool(rest) and options.save_optimizer_state
        if optimizer:
            staging.write_items(os.path.join(temporary, OPTIMIZER_NAME),
                                [entries[i] for i in rest], [sources[i] for i in rest],
                                metadata=metadata, alignment=alignment, durable=False)
        record = step_record(step, options, namespace, optimizer, metadata)
        step_directory.write_text(os.path.join(temporary, TRAINER_STATE_NAME),
                                  json.dumps(record, indent=2, sort_keys=True) + '\n')
    except CheckpointError as e:
        step_directory.remove_staged_dir(temporary)
        e.published_as(temporary, target)  # name the step, not its staging
        raise
    except BaseException:
        step_directory.remove_staged_dir(temporary)
        raise


def finish_step(temporary: str, target: str, *, durable: bool) -> None:
    """Publish a staged step directory as `target`: every file durable, then one rename."""
    step_directory.publish_dir(temporary, target, durable=durable, marker=TRAINER_STATE_NAME)


def staging_remove(temporary: str) -> None:
    """Remove a staged step directory (or file) that will not be published."""
    step_directory.remove_staged_dir(temporary)


# --- reading -------------------------------------------------------------------------------------

def read_metadata(path: str, step: int | None = None) -> dict[str, str]:
    """A step directory's metadata, as a jckpt step file's header would hold it."""
    return metadata_of(step_directory.read_record(path, step))


def metadata_of(record: Mapping[str, Any]) -> dict[str, str]:
    """The metadata of a step directory's record (`trainer_state.json`, checked by
    `step_directory.read_record`), as a jckpt step file's header would hold it."""
    meta = dict(record['metadata'])
    meta[METRICS_KEY] = json.dumps(record.get('metrics', {}), sort_keys=True)
    if record.get('trainer_state') is not None:
        meta[TRAINER_STATE_KEY] = json.dumps(record['trainer_state'], sort_keys=True)
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
                raise _fail(step, file, "the model loader failed", e) from e
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
    (`jckpt.api.targets`: shapes, dtypes, weak types, PRNG keys), then placed."""
    stored = {}
    for p, array in tree_mod.flatten(model):
        stored[p] = stored[tree_mod.loose_path(p)] = np.asarray(array)
    items, treedef = tree_mod.flatten_with_treedef(target)
    requests = []
    for p, leaf in items:
        where = tree_mod.leaf_name(namespace, p)
        array = stored.get(p, stored.get(tree_mod.loose_path(p)))
        if array is None:
            raise MissingEntryError(f"step {step}: the model has no leaf {where}", file=file,
                                    entry=where, fix="the target must have the saved model's structure")
        entry = entry_for(namespace, p, array.dtype, array.shape, id=0)
        try:
            requests.append(targets.take(ctx, entry, array, leaf, file, where, cast=cast))
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
        return api.restore(ctx, {n: target[n] for n in names}, file, cast=cast, namespaces=names,
                           verify=verify)
    raise InputError("with namespaces, the target must be {namespace: subtree}", file=file)


__all__ = ['CheckpointLoadOptions', 'CheckpointOptions', 'finish_step', 'is_step_directory',
           'load_step', 'metadata_of', 'read_metadata', 'stage_step', 'staging_remove',
           'step_record']
