"""The one lineage rule the mirror and the manager follow: continue your own run, refuse anything else."""

import numpy as np
import pytest

import jckpt
from jckpt.services.lineage import MANAGER_STEP, MIRROR_FILE, Lineage, open_lineage

FILE = "/runs/step_00000010.jckpt"


def rule(found, lineage=None, new_lineage=False, holder=MIRROR_FILE):
    return open_lineage(found, file=FILE, lineage=lineage, new_lineage=new_lineage, holder=holder)


def test_nothing_found_starts_the_named_or_a_random_lineage():
    assert rule(None, "exp1") == Lineage("exp1", 0)
    a, b = rule(None), rule(None)
    assert a.generation == 0 and len(a.name) == 32 and a.name != b.name


def test_the_found_lineage_is_continued_after_its_generation():
    found = {"jckpt.lineage": "exp1", "jckpt.generation": "12", "note": "x"}
    assert rule(found) == Lineage("exp1", 12)
    assert rule(found, "exp1") == Lineage("exp1", 12)
    assert rule({"jckpt.lineage": "exp1"}) == Lineage("exp1", 0)   # no generation recorded


@pytest.mark.parametrize("holder", [MIRROR_FILE, MANAGER_STEP])
def test_another_lineage_is_refused_with_the_file_and_the_fix(holder):
    with pytest.raises(jckpt.LineageError, match="belongs to lineage 'exp1', not 'exp2'") as info:
        rule({"jckpt.lineage": "exp1", "jckpt.generation": "3"}, "exp2", holder=holder)
    assert info.value.file == FILE
    assert "lineage='exp1'" in info.value.fix and "new_lineage=True" in info.value.fix


@pytest.mark.parametrize("holder, says", [
    (MIRROR_FILE, "the file was not written by a mirror"),
    (MANAGER_STEP, "the latest step was not written by a checkpoint manager"),
])
@pytest.mark.parametrize("lineage", [None, "exp1"])
def test_a_checkpoint_without_lineage_is_refused_never_joined(holder, says, lineage):
    with pytest.raises(jckpt.LineageError, match=says) as info:
        rule({"note": "saved with jckpt.save"}, lineage, holder=holder)
    assert info.value.file == FILE and "new_lineage=True" in info.value.fix
    assert holder.elsewhere in info.value.fix


def test_an_unreadable_generation_is_refused():
    with pytest.raises(jckpt.LineageError, match="unreadable generation 'seven'") as info:
        rule({"jckpt.lineage": "exp1", "jckpt.generation": "seven"})
    assert "new_lineage=True" in info.value.fix


@pytest.mark.parametrize("found", [
    None, {"note": "no lineage"}, {"jckpt.lineage": "exp1", "jckpt.generation": "7"},
    {"jckpt.lineage": "exp1", "jckpt.generation": "seven"},
])
def test_new_lineage_always_starts_over(found):
    assert rule(found, "exp2", new_lineage=True) == Lineage("exp2", 0)
    assert rule(found, new_lineage=True).generation == 0


@pytest.mark.parametrize("bad", ["", 7, b"exp"])
def test_a_lineage_name_must_be_a_non_empty_string(bad):
    with pytest.raises(jckpt.InputError, match="non-empty string"):
        rule(None, bad)


def test_the_mirror_and_the_manager_refuse_the_same_foreign_checkpoint(tmp_path):
    tree = {"w": np.ones(2, np.float32)}
    jckpt.save(jckpt.Context(), tree, tmp_path / "run.jckpt")
    (tmp_path / "steps").mkdir()
    jckpt.save(jckpt.Context(), tree, tmp_path / "steps" / "step_00000001.jckpt")
    with pytest.raises(jckpt.LineageError, match="not written by a mirror"):
        jckpt.Mirror(tmp_path / "run.jckpt")
    with pytest.raises(jckpt.LineageError, match="not written by a checkpoint manager") as info:
        jckpt.CheckpointManager(tmp_path / "steps")
    assert info.value.file == str(tmp_path / "steps" / "step_00000001.jckpt")
    for bad in ("", 3):
        with pytest.raises(jckpt.InputError, match="non-empty string"):
            jckpt.Mirror(tmp_path / "run.jckpt", lineage=bad)
        with pytest.raises(jckpt.InputError, match="non-empty string"):
            jckpt.CheckpointManager(tmp_path / "steps", lineage=bad)
    with jckpt.Mirror(tmp_path / "run.jckpt", new_lineage=True):   # the refusals released the lease
        pass
    with jckpt.CheckpointManager(tmp_path / "steps", new_lineage=True):
        pass


def test_a_lineage_with_a_lone_surrogate_is_refused_when_the_writer_opens(tmp_path):
    # it was accepted, and every write then failed in the background
    name = 'run-' + '\udcff'
    with pytest.raises(jckpt.InputError, match='lineage .* lone surrogate') as e:
        jckpt.Mirror(tmp_path / 'm.jckpt', lineage=name)
    assert e.value.file == str(tmp_path / 'm.jckpt')
    with pytest.raises(jckpt.InputError, match='lone surrogate'):
        jckpt.CheckpointManager(tmp_path / 'run', lineage=name)
