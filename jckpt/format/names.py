"""Every name jckpt reserves: file names in a directory, staging tags, and metadata keys.

One definition of each, read by the storage layer, the services that write
these names and the tools that recognise them (which must not import JAX).

>>> step_name(100), piece_name(12, 1)
('step_00000100.jckpt', 'process_00012.1.jckpt')
>>> piece_name(3, 0, save_tag(0xab, 4242, 7))
'process_00003.s000000ab0000109200000007.jckpt'
>>> bool(STEP_RE.match(step_name(7))), KNOWN_KEYS[STEP_KEY]
(True, 'step')
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# --- files of a directory checkpoint (one piece file per process, one index) -------------------

#: The index of a directory checkpoint: which piece of which array is in which file.
INDEX_NAME = 'index.jckpt'
#: A piece file: ``process_00003.jckpt``, ``process_00003.1.jckpt`` for a later block, and in an
#: object store with the save's tag: ``process_00003.s<24 hex digits>.jckpt``,
#: ``process_00003.1.s<24 hex digits>.jckpt``. Group 1 is the process, 2 the layer, 3 the tag.
PIECE_RE = re.compile(r'process_([0-9]{5,})(?:\.([1-9][0-9]*))?(?:\.(s[0-9a-f]{24}))?\.jckpt\Z')
#: A save tag: ``s``, then the writer's host (a CRC-32 of its name), its pid and a random
#: number, 8 hex digits each; it starts with a letter, so it never reads as a layer number.
SAVE_TAG_RE = re.compile(r's([0-9a-f]{8})([0-9a-f]{8})([0-9a-f]{8})\Z')
#: The version of the directory layout written in the index.
LAYOUT_VERSION = 1
#: The lock file that keeps a directory checkpoint to one writer.
DIRECTORY_LOCK_NAME = '.writer.lock'


def piece_name(process: int, layer: int = 0, tag: str = '') -> str:
    """The piece file of `process` (`layer` > 0 for a second block of the same array).

    `tag` (a `save_tag`, or empty) names the save that wrote it: a directory
    checkpoint in an object store is replaced by writing the new pieces under
    new names, so they never overwrite the pieces of the checkpoint being replaced.
    """
    return f"process_{process:05d}{f'.{layer}' if layer else ''}{f'.{tag}' if tag else ''}.jckpt"


def save_tag(host: int, pid: int, nonce: int) -> str:
    """The tag of one save: its writer's host hash and pid, and a random `nonce` (32 bits each).

    >>> save_tag(1, 2, 3)
    's000000010000000200000003'
    """
    return f"s{host & 0xffffffff:08x}{pid & 0xffffffff:08x}{nonce & 0xffffffff:08x}"


def tag_writer(tag: str) -> tuple[int, int] | None:
    """`(host hash, pid)` of the save that `tag` names; None when `tag` is not a save tag.

    >>> tag_writer(save_tag(1, 2, 3)), tag_writer('1')
    ((1, 2), None)
    """
    m = SAVE_TAG_RE.match(tag)
    return (int(m.group(1), 16), int(m.group(2), 16)) if m else None


def piece_tag(name: str) -> str | None:
    """The save tag of the piece file `name` (`''` for an untagged piece); None for no piece name.

    >>> piece_tag('process_00000.1.s000000010000000200000003.jckpt'), piece_tag('process_00000.jckpt')
    ('s000000010000000200000003', '')
    """
    m = PIECE_RE.match(name)
    return (m.group(3) or '') if m else None


# --- steps of a manager directory --------------------------------------------------------------

#: Step checkpoints of a manager directory: ``step_00000100.jckpt`` (a file or a directory).
STEP_RE = re.compile(r'step_([0-9]{8,})\.jckpt\Z')  # ASCII digits only, as step_name writes


#: A step whose model is in a foreign format is a directory of three files: the model
#: (``model.<ext>``), the other namespaces (``optimizer.jckpt``) and ``trainer_state.json``,
#: which is written last into the staged directory and marks the step as complete.
MODEL_STEM = 'model'
OPTIMIZER_NAME = 'optimizer.jckpt'
TRAINER_STATE_NAME = 'trainer_state.json'


def step_name(step: int) -> str:
    """The file (or directory) name of `step`: `step_00000100.jckpt`."""
    return f"step_{step:08d}.jckpt"


def is_format_step(directory: str, names: Iterable[str]) -> bool:
    """Whether a directory named `directory` holding `names` is a manager's step in a foreign
    format: a step's name and its record. Hugging Face's Trainer also writes a
    `trainer_state.json`, into `checkpoint-500/`, which is no step of ours.

    >>> is_format_step('run/step_00000002.jckpt', ['model.npz', 'trainer_state.json'])
    True
    >>> is_format_step('out/checkpoint-500', ['model.safetensors', 'trainer_state.json'])
    False
    """
    name = directory.replace('\\', '/').rstrip('/').rpartition('/')[2]
    return bool(STEP_RE.match(name)) and TRAINER_STATE_NAME in names


def is_step_member(name: str) -> bool:
    """Whether a manager writes files of this name into a step directory: its index and
    pieces, its model, optimizer and record, their staging names, and the lock of a directory
    checkpoint's writer (left in place by one killed as it published). A step-named directory
    holding anything else is somebody's own, and no unfinished step to remove.

    >>> [is_step_member(n) for n in ('model.safetensors', 'process_00000.jckpt', 'notes.txt')]
    [True, True, False]
    """
    return (name in (INDEX_NAME, OPTIMIZER_NAME, TRAINER_STATE_NAME, DIRECTORY_LOCK_NAME)
            or bool(PIECE_RE.match(name))
            or name.startswith('model.') or '.jckpt-' in name)


# --- staging and leases (siblings of what they protect) ----------------------------------------

#: A staging file: ``<target>.jckpt-stage.<pid>.<counter>.<random>``, renamed over the target when complete.
STAGE_TAG = '.jckpt-stage.'
#: A staging directory of a directory checkpoint being published.
STAGE_DIR_TAG = '.jckpt-stage-dir.'
#: A directory checkpoint set aside while its replacement is renamed in, where the
#: filesystem cannot swap two paths: ``<target>.jckpt-old.<random>``.
OLD_DIR_TAG = '.jckpt-old.'
#: A staged generation of a mirror: ``<target>.jckpt-next.<seq>``, published in order.
NEXT_TAG = '.jckpt-next.'
#: The writer lease beside a path: ``<target>.jckpt-lease``.
LEASE_SUFFIX = '.jckpt-lease'
#: The marker of a multipart upload in flight in an object store: ``<key>.jckpt-upload.<random>``,
#: so that the next writer of the key can find and abort the uploads of a writer that was killed.
UPLOAD_TAG = '.jckpt-upload.'

# --- metadata keys -----------------------------------------------------------------------------

#: Keys that start with this belong to jckpt; user metadata may not use them.
RESERVED_PREFIX = 'jckpt.'
#: The training step of a manager checkpoint.
STEP_KEY = 'jckpt.step'
#: The metrics of a manager checkpoint (JSON).
METRICS_KEY = 'jckpt.metrics'
#: The trainer state of a manager checkpoint (JSON, :class:`jckpt.TrainerState`).
TRAINER_STATE_KEY = 'jckpt.trainer_state'
#: The lineage (a random id) shared by the generations of a mirror or the steps of a manager.
LINEAGE_KEY = 'jckpt.lineage'
#: The generation number of a mirrored file.
GENERATION_KEY = 'jckpt.generation'
#: The key paths of the saved tree's nodes without leaves (optax's `EmptyState`, `None`,
#: empty tuples, lists and dicts), by namespace (JSON), so exports can rebuild them.
EMPTY_NODES_KEY = 'jckpt.empty_nodes'
#: The JSON items of an orbax step read or converted from it: `{"item": value}` (JSON).
ORBAX_JSON_KEY = 'jckpt.orbax_json'
#: The save a directory checkpoint's piece files and index belong to (an id the processes of
#: one save share), so that a piece file copied in from another save is refused.
SAVE_KEY = 'jckpt.save'
#: The reserved keys, under the names the tools show them by.
KNOWN_KEYS = {STEP_KEY: 'step', METRICS_KEY: 'metrics', TRAINER_STATE_KEY: 'trainer state',
              LINEAGE_KEY: 'lineage', GENERATION_KEY: 'generation',
              EMPTY_NODES_KEY: 'empty nodes', ORBAX_JSON_KEY: 'orbax JSON items',
              SAVE_KEY: 'save'}
