"""Barriers and shared values between processes, against a stand-in for JAX's distributed client
(the multi-process runs themselves are in tests/system/test_multiprocess.py)."""

import pytest

import jckpt
from jckpt.api import runtime as runtime_mod
from jckpt.api.runtime import Runtime
from tests.kv_client import FakeClient


def runtime(client):
    rt = Runtime.__new__(Runtime)
    rt.client, rt.local, rt.tag, rt.path, rt.timeout_ms = client, False, "t", "ckpt", 300
    rt.here = None
    rt.announce, rt.process, rt.processes = "ckpt", 0, 2
    return rt


def test_a_peer_checks_only_the_phase_it_passed():
    """Process 0's publish error, reported while a peer still checked the phase before, made the
    peer fail there and never meet process 0 at the last barrier."""
    client = FakeClient()
    rt = runtime(client)
    rt.report("published", 0, ValueError("processes disagree about this array"))
    rt.together("written", "wrote its pieces", 1, None)  # passes: not this phase's error
    with pytest.raises(jckpt.DistributedError, match="process 0: ValueError: processes disagree"):
        rt.together("published", "saw the checkpoint published", 1, None)
    assert client.met == ["written", "published"]  # it met process 0 at both barriers


def test_a_failing_step_raises_its_own_error_not_the_barriers():
    client = FakeClient(blocked={"published"})
    rt = runtime(client)

    def publish():
        raise ValueError("the index could not be written")

    with pytest.raises(ValueError, match="the index could not be written"):
        rt.together("published", "saw the checkpoint published", 0, publish)
    assert client.kv["t/error/published/0"] == "ValueError: the index could not be written"
    assert "t/at/published/0" in client.kv  # it came to the barrier: a timeout names who did not


def test_a_barrier_that_times_out_says_what_is_known():
    rt = runtime(FakeClient(blocked={"written", "published"}))
    with pytest.raises(jckpt.DistributedError, match="nothing was published"):
        rt.barrier("written", "wrote its pieces")
    with pytest.raises(jckpt.DistributedError, match="whether it was published is not known") as e:
        rt.barrier("published", "saw the checkpoint published")
    assert "of 0.3; process 1 did not come)" in str(e.value), e.value
    assert "(the barrier timed out)" in str(e.value)


def test_the_barrier_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("JCKPT_BARRIER_TIMEOUT", "12.5")
    assert runtime_mod.barrier_timeout() == 12.5
    monkeypatch.setenv("JCKPT_BARRIER_TIMEOUT", "soon")
    with pytest.raises(jckpt.InputError, match="JCKPT_BARRIER_TIMEOUT='soon'"):
        runtime_mod.barrier_timeout()


class CountingClient(FakeClient):
    """A client with JAX's atomic increment (the settle of a meeting's outcome)."""

    def key_value_increment(self, key, increment):
        self.kv[key] = int(self.kv.get(key, 0)) + increment
        return self.kv[key]


@pytest.mark.parametrize("kind", [FakeClient, CountingClient])
def test_the_first_process_to_settle_a_meetings_outcome_decides_it(kind):
    """A process leaving a meeting failing and one that met every other there must not end it
    differently: the first to settle decides, whatever the client offers."""
    rt = runtime(kind())
    assert rt._settle("said", "met") and rt._settle("said", "met")  # every process that met
    assert not rt._settle("said", "failed")  # it met: a process leaving late passes instead
    rt = runtime(kind())
    assert rt._settle("said", "failed") and not rt._settle("said", "met")  # a latecomer fails
    assert rt._settle("said", "failed")  # and so does every other process timing out there
