"""What a process tells the others of its failure, and the one error they all raise from it."""

import jckpt
from jckpt.api.outcomes import common, described, first_line, told


def test_a_jckpt_error_travels_whole_and_is_raised_again_as_its_class():
    said = described(jckpt.InputError("step must be an int", file="run", fix="pass an int"))
    e = common("saving a checkpoint", "run", [(1, said)])
    assert type(e) is jckpt.InputError and e.fix == "pass an int"
    assert e.message == ("saving a checkpoint failed in 1 of the run's processes (process 1: step "
                         "must be an int)")


def test_another_error_travels_as_its_type_and_first_line_and_is_a_distributed_error():
    said = described(ValueError("bad shape\nmore"))
    assert said == {"type": "DistributedError", "message": "ValueError: bad shape", "fix": None}
    assert type(common("restoring", "a.jckpt", [(0, said)])) is jckpt.DistributedError
    assert described(None)["type"] is None
    assert first_line(KeyError()) == "KeyError" and told(jckpt.InputError("x")) == "x"
