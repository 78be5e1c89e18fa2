"""`TrainerState`: the small facts a run needs to resume exactly, stored as JSON metadata.

Arrays go in the checkpoint's tensors; the counters around them (how many
steps and batches, the last learning rate, the best loss so far, the
parallel layout the run used, and anything else the user wants) go in the
header's metadata under `jckpt.trainer_state`, readable without loading a
single payload.

>>> s = TrainerState(global_step=100, consumed_batches=100, learning_rate=3e-4,
...                  best_loss=0.25, dp=4, user={'seed': 0})
>>> TrainerState.from_json(s.to_json()) == s
True
>>> s.replace(dp=8).layout
(8, 1, 1)
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import reprlib
from collections.abc import Mapping
from typing import Any

from jckpt.errors import FormatError, InputError, MismatchError
from jckpt.format import strict_json
from jckpt.format.names import TRAINER_STATE_KEY

_LAYOUT_NAMES = ('dp', 'tp', 'pp')
_DAMAGED = "the metadata is damaged: restore an earlier step, or pass the text to_json wrote"


def _count(value: Any, name: str) -> int:
    """A counter field as an `int` (a numpy or 0-d JAX integer too); `InputError` otherwise."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 0:
        raise InputError(f"TrainerState.{name} must be a non-negative integer, not "
                         f"{type(value).__name__} {reprlib.repr(value):.80}",
                         fix=f"pass int({name})" if count is None else None)
    return count


def _number(value: Any, name: str) -> float | None:
    """An optional real field as a `float` (a numpy or 0-d JAX number too: a schedule's
    output); `InputError` otherwise."""
    if value is None or type(value) is float:
        return value
    if not isinstance(value, (bool, str, bytes)) and getattr(value, 'ndim', 0) == 0:
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):  # 10**400 from a crafted record
            pass
    raise InputError(f"TrainerState.{name} must be a real number or None, not "
                     f"{type(value).__name__} {reprlib.repr(value):.80}", fix=f"pass float({name})")


#: The values `user` holds as they are (besides dicts, lists, tuples and 0-d numpy or JAX scalars).
_JSON_VALUES = (str, int, float, bool, type(None))


def _check_keys(user: Mapping[str, Any]) -> None:
    """Refuse a key of `user`, at any depth, that is not a string: JSON would bring `{1: 2}`
    back as `{'1': 2}`, and a lookup by the integer after a resume would fail far from here.
    Refuse a value JSON cannot hold (a set, an array, an object) where it sits, too: it was
    refused only by the manager's save, naming neither the key nor the step."""
    stack: list[tuple[str, Any]] = [('user', user)]
    seen: set[int] = set()
    while stack:
        where, node = stack.pop()
        if id(node) in seen:  # a cycle: json.dumps names it
            continue
        seen.add(id(node))
        if isinstance(node, Mapping):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise InputError(
                        f"TrainerState.{where} has the key {reprlib.repr(key)}, not a string: "
                        f"JSON would bring it back as {reprlib.repr(str(key))}",
                        fix="use string keys (str(key)), and turn them back after a restore")
                _check_text(key, f"{where} key")
                stack.append((f"{where}[{key!r}]", value))
        elif isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{where}[{i}]", value) for i, value in enumerate(node))
        elif not isinstance(node, _JSON_VALUES) and not (
                getattr(node, 'ndim', None) == 0 and hasattr(node, 'item')):
            raise InputError(f"TrainerState.{where} is a {type(node).__name__} "
                             f"({reprlib.repr(node):.60}), which JSON cannot hold",
                             fix="keep user fields to numbers, strings, lists and dicts (a set as "
                                 "sorted(s), an array as a.tolist())")


def _check_text(text: str, where: str) -> None:
    """Refuse a string no UTF-8 text holds (a lone surrogate, as `os.fsdecode` makes of a
    file name's bad byte): the step was saved, and its trainer state then read as damaged."""
    try:
        text.encode('utf-8')
    except UnicodeEncodeError:
        raise InputError(f"TrainerState.{where} ({reprlib.repr(text):.60}) holds a lone "
                         "surrogate, which no UTF-8 text, and so no checkpoint's JSON, can hold",
                         fix="store the text encoded (text.encode('utf-8', 'surrogateescape')"
                             ".hex()), or drop the character") from None


def _scalar(value: Any) -> Any:
    """`json.dumps`'s fallback for `user`: a numpy or 0-d JAX scalar as its Python value."""
    if getattr(value, 'ndim', None) == 0 and hasattr(value, 'item'):
        return strict_json.strict(value.item())
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """Where a training run stands, beyond its arrays.

    Attributes:
      global_step: optimizer steps taken.
      consumed_batches: batches drawn from the data pipeline (to skip on resume).
      learning_rate: the last learning rate used (`None` if not tracked).
      best_loss: the best loss seen so far (`None` if not tracked).
      dp, tp, pp: data-, tensor- and pipeline-parallel sizes of the run.
      user: any other JSON-serializable fields, under string keys (tuples come back as
        lists, as JSON has them). The state keeps a copy, taken when it is made, so what the
        caller changes in its own dict afterwards is not in the state; change it with
        `replace(user=...)`.

    A state is a value: states of equal fields are equal, and hashable (as a dict key or in a
    set), whatever `user` holds; the hash leaves `user` out, which equal states agree on.

    Stored as strict JSON: a non-finite float (a loss gone NaN) is written
    `{"$float": "nan"}` and comes back as the float.
    """

    global_step: int = 0
    consumed_batches: int = 0
    learning_rate: float | None = None
    best_loss: float | None = None
    dp: int = 1
    tp: int = 1
    pp: int = 1
    user: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ('global_step', 'consumed_batches', *_LAYOUT_NAMES):
            object.__setattr__(self, name, _count(getattr(self, name), name))
        for name in _LAYOUT_NAMES:
            if getattr(self, name) < 1:
                raise InputError(f"TrainerState.{name} must be at least 1")
        for name in ('learning_rate', 'best_loss'):
            object.__setattr__(self, name, _number(getattr(self, name), name))
        if not isinstance(self.user, Mapping):
            raise InputError(f"TrainerState.user must be a mapping, not {type(self.user).__name__}")
        _check_keys(self.user)
        object.__setattr__(self, 'user', copy.deepcopy(dict(self.user)))  # the caller's dict may change

    def __hash__(self) -> int:
        """The hash of every field but `user` (a dict, unhashable; equal states have equal fields,
        and so equal hashes).

        >>> len({TrainerState(user={'seed': 0}), TrainerState(user={'seed': 0})})
        1
        """
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != 'user'))

    @property
    def layout(self) -> tuple[int, int, int]:
        """`(dp, tp, pp)`."""
        return (self.dp, self.tp, self.pp)

    def replace(self, **changes: Any) -> TrainerState:
        """A copy with `changes` applied."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise InputError(f"TrainerState has no field {unknown[0]!r}",
                             fix=f"use one of {fields}, or keep your own values in user=")
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The state as a strict JSON object: a non-finite float (a loss gone NaN, in
        `best_loss`, `learning_rate` or `user`) is written `{"$float": "nan"}` (`"inf"`,
        `"-inf"`), which any JSON parser reads and `from_json` turns back into the float.

        >>> TrainerState(best_loss=float('inf')).to_json()  # doctest: +ELLIPSIS
        '{"best_loss": {"$float": "inf"}, ...}'
        """
        fields = dataclasses.asdict(self)
        fields['user'] = dict(self.user)
        try:
            return strict_json.dumps(fields, sort_keys=True, default=_scalar)
        except (TypeError, ValueError) as e:
            raise InputError(f"TrainerState.user is not JSON-serializable: {e}",
                             fix="keep user fields to numbers, strings, lists and dicts") from None

    @classmethod
    def from_json(cls, text: str, *, file: str | None = None) -> TrainerState:
        """Parse `to_json`'s output; unknown fields land in `user` under `_unknown`. The
        `NaN` and `Infinity` that versions before strict JSON wrote read as those floats."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise InputError(f"from_json takes the JSON text, not {type(text).__name__}", file=file,
                             fix="pass the string to_json returned")
        try:
            fields = strict_json.loads(text)
        except ValueError as e:
            raise FormatError(f"trainer state is not valid JSON: {e}", file=file,
                              fix=_DAMAGED) from None
        if not isinstance(fields, dict):
            raise FormatError("trainer state is not a JSON object", file=file, fix=_DAMAGED)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = {k: v for k, v in fields.items() if k not in known}
        kwargs = {k: v for k, v in fields.items() if k in known}
        if unknown:
            user = kwargs.get('user', {})
            if not isinstance(user, dict):
                raise FormatError(f"invalid trainer state: user is a {type(user).__name__}, not "
                                  "an object", file=file, fix="the metadata is damaged")
            kwargs['user'] = {**user, '_unknown': unknown}
        try:
            return cls(**kwargs)
        except InputError as e:
            raise FormatError(f"invalid trainer state: {e.message}", file=file,
                              fix=_DAMAGED) from None

    def check_layout(self, current: TrainerState | tuple[int, int, int], *, reshard: bool,
                     file: str | None = None) -> TrainerState:
        """This (stored) state adapted to the `current` run's layout, or a refusal.

        A checkpoint holds every array whole, so a different `(dp, tp, pp)`
        is a matter of placing the arrays on the new run's shardings. With
        `reshard` the returned state carries the current layout; without it a
        different layout raises `MismatchError`.
        """
        layout = current.layout if isinstance(current, TrainerState) else tuple(current)
        if len(layout) != 3 or not all(isinstance(n, int) and n >= 1 for n in layout):
            raise InputError(f"layout must be (dp, tp, pp) positive integers, not {current!r}")
        if layout == self.layout:
            return self
        stored = ' '.join(f"{n}={v}" for n, v in zip(_LAYOUT_NAMES, self.layout))
        wanted = ' '.join(f"{n}={v}" for n, v in zip(_LAYOUT_NAMES, layout))
        if not reshard:
            raise MismatchError(f"the checkpoint was written with {stored}, this run uses "
                                f"{wanted}", file=file,
                                fix="resume with the original layout, or pass reshard=True "
                                    "to place the arrays on this run's shardings")
        return self.replace(**dict(zip(_LAYOUT_NAMES, layout)))


__all__ = ['TRAINER_STATE_KEY', 'TrainerState']
