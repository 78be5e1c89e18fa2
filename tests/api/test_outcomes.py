"""What a process tells the others of its failure, and the one error they all raise from it."""

import jckpt
from jckpt.api.outcomes import common, described, first_line, own_error, refused_by, told


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


def test_a_save_argument_refused_in_one_process_is_the_same_error_in_every_process():
    """A manager's metric one process could not store failed its save as an InputError there,
    and as a DistributedError in the others; now as the one InputError, naming that process."""
    import json

    own = jckpt.InputError("metric 'loss' is not a number", file="run", fix="pass numbers")
    posted = [("1", json.dumps(described(own)))]
    here = refused_by(posted, "run/step_2", own, own)  # in process 1
    there = refused_by(posted, "run/step_2", jckpt.DistributedError("the save failed"), None)
    assert type(here) is type(there) is jckpt.InputError and str(here) == str(there)
    assert here.__cause__ is own and there.__cause__ is None
    assert "(process 1: metric 'loss' is not a number)" in there.message and there.fix == "pass numbers"
    assert refused_by([], "run", own, own) is None
    assert type(own_error(ValueError("x"), "run", 2)) is jckpt.DistributedError
    assert own_error(own, "run", 2) is own
