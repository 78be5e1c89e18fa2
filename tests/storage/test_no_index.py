"""What a directory without an index is told to do: each kind of directory its own fix."""

import pytest

from jckpt.storage.no_index import FOREIGN_MARKERS, no_index_fix


def test_an_empty_or_unreadable_directory_is_told_to_restore_a_complete_checkpoint(tmp_path):
    assert no_index_fix(str(tmp_path)) == "restore from a complete checkpoint"
    assert no_index_fix(str(tmp_path / "gone")) == "restore from a complete checkpoint"


@pytest.mark.parametrize("marker", FOREIGN_MARKERS)
def test_an_orbax_item_or_step_is_told_to_convert(tmp_path, marker):
    (tmp_path / marker).write_text("{}")
    fix = no_index_fix(str(tmp_path))
    assert fix.startswith("this is an orbax checkpoint") and "jckpt.convert(" in fix


def test_a_folder_holding_an_orbax_step_names_the_step(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "_CHECKPOINT_METADATA").write_text("{}")
    assert no_index_fix(str(tmp_path)).startswith(f"{str(tmp_path / 'final')!r} in it")


def test_a_managers_step_in_another_format_is_told_to_restore_through_the_manager(tmp_path):
    step = tmp_path / "step_00000042.jckpt"
    step.mkdir()
    (step / "model.safetensors").write_bytes(b"")
    (step / "trainer_state.json").write_text("{}")
    assert no_index_fix(str(step)) == (f"this is a checkpoint manager's step: restore it with "
                                       f"jckpt.CheckpointManager({str(tmp_path)!r}).restore(42)")


def test_a_managers_directory_is_told_to_restore_through_the_manager_or_name_a_step(tmp_path):
    for n in (1, 2):
        (tmp_path / f"step_{n:08d}.jckpt").write_bytes(b"")
    fix = no_index_fix(str(tmp_path))
    assert fix.startswith("this is a checkpoint manager's directory")
    assert repr(str(tmp_path / "step_00000002.jckpt")) in fix
