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
sees the complete step or none of it. Restore (`jckpt.services.format_reading`)
peeks at the model file's first bytes to pick the reader (a jckpt file named
`model.bin` still reads as jckpt), or calls `CheckpointLoadOptions.model_loader(path)`,
and reads `optimizer.jckpt` only when asked and present.

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

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jckpt import adapters
from jckpt.adapters.numpy import name_loss_told
from jckpt.api.context import Context
from jckpt.errors import (
    CheckpointError,
    InputError,
    StorageError,
)
from jckpt.format import strict_json
from jckpt.format.names import (
    METRICS_KEY,
    MODEL_STEM,
    OPTIMIZER_NAME,
    TRAINER_STATE_KEY,
    TRAINER_STATE_NAME,
)
from jckpt.services.snapshot import SnapshotLeaf
from jckpt.storage import staging, step_directory
from jckpt.storage.publish import storage_error
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import unflatten

#: The model file's extension where the format's first one is not the usual one.
_EXTENSIONS = {'torch': '.pth'}
#: Registered formats whose writer makes a directory: a step's model is one file.
_DIRECTORY_FORMATS = frozenset({'orbax'})
#: Registered formats whose file holds one array and no name (a target of one leaf takes it).
_NAMELESS_FORMATS = frozenset({'npy'})


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
        hold, or by the callback) or a fault of the callback's own (a
        `TypeError`, `ValueError`, `KeyError`, ...): that step is dropped and
        the next `wait_durable` (or `close`) raises it, so that later steps
        are still written.
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
        name = adapters.format_name(self.format)
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

    def refuse_directory_steps(self, directory_steps: bool, directory: str) -> None:
        """`InputError` for a model in another format in a multi-process directory step, which
        holds jckpt pieces only."""
        if self.foreign and directory_steps:
            raise InputError(f"multi-process directory steps are jckpt only, and the options ask "
                             f"for format {self.format!r}", file=directory,
                             fix='use CheckpointOptions(format="jckpt") (the default) with several '
                                 "processes, or directory_steps=False in a run of one process")

    def model_namespace_of(self, items: Mapping[str, Any] | None, namespace: str, *,
                           directory_steps: bool, directory: str) -> str:
        """The namespace a step saved with these options writes as its model ('' for jckpt
        steps): `namespace` (the context's) for a tree, `model_namespace` for `items`.

        >>> CheckpointOptions(format='safetensors').model_namespace_of(
        ...     None, 'jckpt', directory_steps=False, directory='run')
        'jckpt'
        """
        if not self.foreign:
            return ''
        self.refuse_directory_steps(directory_steps, directory)
        if items is None:
            return namespace
        if self.model_namespace not in items:
            raise InputError(f"items has no model namespace {self.model_namespace!r}",
                             file=directory, fix="pass the model as items[model_namespace], "
                             "or set CheckpointOptions(model_namespace=...)")
        return self.model_namespace

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

def model_error(step: int, file: str, what: str, e: BaseException) -> CheckpointError:
    """The error of a failed model write (or of a `model_loader`), naming the step and `file`.

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
        return storage_error(e, f"step {step}: {what}", file)
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
    if options.format not in _NAMELESS_FORMATS:
        return
    paths = [p for p, _ in tree_mod.flatten(trees[namespace])]
    if paths and paths[0]:  # a bare array has no name
        warnings.warn(f"step {step}: the model, {tree_mod.leaf_name(namespace, paths[0])}, is "
                      f"written to {named}, which holds one array and no name: "
                      f"restore({step}) without a target gives the bare array (namespace "
                      f"{namespace!r}); restore with a target of one leaf to get it under its name "
                      "(or save with format='npz', which keeps names)", stacklevel=3)


#: The models (check, namespace, structure, dtypes and shapes) that passed `check_model`.
_PASSED: set[tuple] = set()


def _write_model(options: CheckpointOptions, model: Any, namespace: str, path: str,
                 step: int, named: str) -> None:
    """Write the model to `path`; errors name the step and `named`, the file once published."""
    try:
        if options.model_writer is not None:
            options.model_writer(model, path)
        else:
            with name_loss_told():  # `check_model` told it, naming the step, not the staging
                adapters.write({namespace: model}, path, format=options.format)
    except Exception as e:
        raise model_error(step, named, f"writing the model as {options.format}", e) from e
    if not step_directory.is_file(path):  # no retry writes it: dropped as the callback's fault
        what = "a directory, not one file" if os.path.isdir(path) else "no file"
        raise InputError(f"step {step}: the model writer wrote {what}", file=named,
                         fix="model_writer(tree, path) must write one file at path")


def step_record(step: int, options: CheckpointOptions, namespace: str, optimizer: bool,
                metadata: Mapping[str, str]) -> dict[str, Any]:
    """What `trainer_state.json` holds: readable fields, and the metadata to rebuild the header's
    (its values decoded, for `stage_step` to write them as strict JSON, `jckpt.format.strict_json`)."""
    rest = {k: v for k, v in metadata.items() if k not in (METRICS_KEY, TRAINER_STATE_KEY)}
    state = metadata.get(TRAINER_STATE_KEY)
    return {'step': step, 'model': options.model_file, 'model_format': options.format,
            'model_namespace': namespace, 'optimizer': OPTIMIZER_NAME if optimizer else None,
            'trainer_state': None if state is None else strict_json.loads(state),
            'metrics': strict_json.loads(metadata.get(METRICS_KEY, '{}')), 'metadata': rest}


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
                                  strict_json.dumps(record, indent=2, sort_keys=True) + '\n')
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


__all__ = ['CheckpointLoadOptions', 'CheckpointOptions', 'check_model', 'finish_step',
           'is_step_directory', 'model_error', 'stage_step', 'staging_remove', 'step_record']
