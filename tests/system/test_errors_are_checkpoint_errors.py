"""Every failure of a public call on bad arguments is a `CheckpointError` with a fix or a reason.

The docs promise that one `except jckpt.CheckpointError` catches everything jckpt
refuses. Each case below calls a public function (from `jckpt.__all__`) or a public
method of a public class with arguments of the wrong type or value, as a user might
by mistake, and checks that what comes back is a `CheckpointError` (not a bare
`TypeError`, `AttributeError` or `ValueError` from inside), and that nothing was
written where a path was given.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import jckpt
from jckpt.tools.diff import diff

TREE = {"w": np.arange(3, dtype=np.float32)}
CTX = jckpt.Context()

# name -> call(tmp) with bad arguments; `tmp` is a directory holding ok.jckpt.
CALLS = {
    # save
    "save: path of the wrong type": lambda t: jckpt.save(CTX, TREE, 5),
    "save: path None": lambda t: jckpt.save(CTX, TREE, None),
    "save: ctx None": lambda t: jckpt.save(None, TREE, f"{t}/a.jckpt"),
    "save: ctx a string": lambda t: jckpt.save("jckpt", TREE, f"{t}/a.jckpt"),
    "save: negative alignment": lambda t: jckpt.save(CTX, TREE, f"{t}/a.jckpt", alignment=-1),
    "save: alignment a string": lambda t: jckpt.save(CTX, TREE, f"{t}/a.jckpt", alignment="8"),
    "save: metadata not a mapping": lambda t: jckpt.save(CTX, TREE, f"{t}/a.jckpt", metadata=[1]),
    "save: metadata value a number": lambda t: jckpt.save(CTX, TREE, f"{t}/a.jckpt",
                                                          metadata={"step": 3}),
    "save: a leaf that is not an array": lambda t: jckpt.save(CTX, {"w": object()}, f"{t}/a.jckpt"),
    # load, restore, describe
    "load: path of the wrong type": lambda t: jckpt.load(CTX, 5),
    "load: ctx None": lambda t: jckpt.load(None, f"{t}/ok.jckpt"),
    "load: prefix not a string": lambda t: jckpt.load(CTX, f"{t}/ok.jckpt", prefix_namespace=3),
    "load: namespaces a number": lambda t: jckpt.load(CTX, f"{t}/ok.jckpt", namespaces=3),
    "restore: path of the wrong type": lambda t: jckpt.restore(CTX, TREE, 5),
    "restore: ctx None": lambda t: jckpt.restore(None, TREE, f"{t}/ok.jckpt"),
    "restore: ctx a string": lambda t: jckpt.restore("jckpt", TREE, f"{t}/ok.jckpt"),
    "restore: namespaces= with a list target": lambda t: jckpt.restore(
        CTX, [TREE["w"]], f"{t}/ok.jckpt", namespaces=["jckpt"]),
    "restore: namespaces= with an array target": lambda t: jckpt.restore(
        CTX, TREE["w"], f"{t}/ok.jckpt", namespaces="jckpt"),
    "restore: namespaces a number": lambda t: jckpt.restore(CTX, {"jckpt": TREE}, f"{t}/ok.jckpt",
                                                            namespaces=3),
    "restore: namespace a number": lambda t: jckpt.restore(CTX, TREE, f"{t}/ok.jckpt", namespace=3),
    "restore: a target leaf that is a string": lambda t: jckpt.restore(CTX, {"w": "x"}, f"{t}/ok.jckpt"),
    "describe: path of the wrong type": lambda t: jckpt.describe(5),
    "describe: path None": lambda t: jckpt.describe(None),
    # Context and prefix_namespace
    "Context: negative alignment": lambda t: jckpt.Context(alignment=-1),
    "Context: alignment a string": lambda t: jckpt.Context(alignment="x"),
    "Context: namespace a number": lambda t: jckpt.Context(namespace=3),
    "Context.replace: unknown field": lambda t: CTX.replace(nmespace="x"),
    "Context.replace: negative alignment": lambda t: CTX.replace(alignment=-2),
    "prefix_namespace: not a loaded tree": lambda t: jckpt.prefix_namespace(5, "p"),
    "prefix_namespace: prefix a number": lambda t: jckpt.prefix_namespace({"a": {}}, 3),
    # the tools
    "info: path of the wrong type": lambda t: jckpt.info(5),
    "verify: path of the wrong type": lambda t: jckpt.verify(5),
    "diff: path of the wrong type": lambda t: diff(5, f"{t}/ok.jckpt"),
    "diff: path None": lambda t: diff(f"{t}/ok.jckpt", None),
    "consolidate: directory of the wrong type": lambda t: jckpt.consolidate(5, f"{t}/x.jckpt"),
    "consolidate: file of the wrong type": lambda t: jckpt.consolidate(f"{t}/ok.jckpt", 5),
    # the adapters
    "convert: source of the wrong type": lambda t: jckpt.convert(5, f"{t}/x.jckpt"),
    "convert: destination of the wrong type": lambda t: jckpt.convert(f"{t}/ok.jckpt", 5),
    "convert: unknown format": lambda t: jckpt.convert(f"{t}/ok.jckpt", f"{t}/x.out", format="nope"),
    "convert: format a number": lambda t: jckpt.convert(f"{t}/ok.jckpt", f"{t}/x.out", format=3),
    "detect_format: path of the wrong type": lambda t: jckpt.detect_format(5),
    "register_format: name a number": lambda t: jckpt.register_format(3, read=lambda p: {}),
    "register_format: read None": lambda t: jckpt.register_format("bad_read", read=None),
    "register_format: write not callable": lambda t: jckpt.register_format(
        "bad_write", read=lambda p: {}, write="w"),
    "register_format: extensions a number": lambda t: jckpt.register_format(
        "bad_ext", read=lambda p: {}, extensions=5),
    "register_format: extensions a string": lambda t: jckpt.register_format(
        "bad_ext", read=lambda p: {}, extensions=".mine"),
    # the mirror and the manager
    "Mirror: path of the wrong type": lambda t: jckpt.Mirror(5),
    "Mirror: ctx a string": lambda t: jckpt.Mirror(f"{t}/m.jckpt", ctx="jckpt"),
    "Mirror: no slots": lambda t: jckpt.Mirror(f"{t}/m.jckpt", slots=0),
    "Mirror: when_full unknown": lambda t: jckpt.Mirror(f"{t}/m.jckpt", when_full="x"),
    "Mirror: lineage a number": lambda t: jckpt.Mirror(f"{t}/m.jckpt", lineage=5),
    "CheckpointManager: directory of the wrong type": lambda t: jckpt.CheckpointManager(5),
    "CheckpointManager: ctx a string": lambda t: jckpt.CheckpointManager(f"{t}/run", ctx="jckpt"),
    "CheckpointManager: negative keep_last": lambda t: jckpt.CheckpointManager(f"{t}/run", keep_last=-1),
    "CheckpointManager: best_mode unknown": lambda t: jckpt.CheckpointManager(
        f"{t}/run", best_metric="loss", best_mode="up"),
    "CheckpointManager: no save interval": lambda t: jckpt.CheckpointManager(
        f"{t}/run", save_interval_steps=0),
    # the trainer state
    "TrainerState: dp 0": lambda t: jckpt.TrainerState(dp=0),
    "TrainerState: user a list": lambda t: jckpt.TrainerState(user=[1]),
    "TrainerState: a user key not a string": lambda t: jckpt.TrainerState(user={"a": {1: 2}}),
    "TrainerState.replace: unknown field": lambda t: jckpt.TrainerState().replace(step=1),
    "TrainerState.from_json: not text": lambda t: jckpt.TrainerState.from_json(5),
    "TrainerState.from_json: not JSON": lambda t: jckpt.TrainerState.from_json("{"),
}


@pytest.fixture
def tmp(tmp_path):
    jckpt.save(CTX, TREE, tmp_path / "ok.jckpt")
    return tmp_path


def _call(call, tmp) -> jckpt.CheckpointError:
    before = sorted(os.listdir(tmp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(jckpt.CheckpointError) as caught:
            call(tmp)
    assert sorted(os.listdir(tmp)) == before, "a refused call left something behind"
    return caught.value


@pytest.mark.parametrize("name", list(CALLS))
def test_bad_arguments_are_checkpoint_errors(name, tmp):
    err = _call(CALLS[name], tmp)
    assert str(err), "the error says what is wrong"


def test_wrong_types_are_input_errors_that_say_the_fix(tmp):
    """A path or ctx of the wrong type is an InputError (also a TypeError) that says what to pass."""
    for call in (lambda t: jckpt.save(CTX, TREE, 5), lambda t: jckpt.restore("jckpt", TREE, f"{t}/ok.jckpt")):
        err = _call(call, tmp)
        assert isinstance(err, jckpt.InputError) and isinstance(err, TypeError)
        assert err.fix


def test_bad_arguments_to_methods_of_a_live_mirror_and_manager(tmp):
    with jckpt.Mirror(tmp / "m.jckpt") as mirror, jckpt.CheckpointManager(tmp / "run") as manager:
        manager.save(1, TREE, metrics={"loss": 1.0})
        manager.wait_durable()
        calls = [
            lambda: mirror.submit(TREE, metadata={"step": 1}),
            lambda: mirror.submit(TREE, metadata=[1]),
            lambda: mirror.submit(TREE, timeout="soon"),
            lambda: mirror.submit({"w": object()}),
            lambda: mirror.wait_durable(timeout="soon"),
            lambda: manager.save("2", TREE),
            lambda: manager.save(-1, TREE),
            lambda: manager.save(3, TREE, metrics="loss"),
            lambda: manager.save(3, TREE, metrics={"loss": "low"}),
            lambda: manager.save(3, items=[TREE]),
            lambda: manager.save(3, TREE, metadata={"a": 1}),
            lambda: manager.save(3, TREE, trainer_state="state"),
            lambda: manager.save(3, TREE, timeout="soon", force=True),
            lambda: manager.should_save("1"),
            lambda: manager.restore("1", TREE),
            lambda: manager.restore(99, TREE),
            lambda: manager.restore(1, TREE, ctx="jckpt"),
            lambda: manager.metrics("1"),
            lambda: manager.best_step(),
            lambda: manager.best_step("loss", "up"),
            lambda: manager.wait_durable(timeout="soon"),
        ]
        for number, call in enumerate(calls):
            with pytest.raises(jckpt.CheckpointError):
                call()
            assert manager.latest_step() == 1, f"call {number} saved a step"
