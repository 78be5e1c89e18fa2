"""jckpt.services.jobs: a job drains and hashes its snapshot once, and lets go of it once durable."""

import dataclasses

import numpy as np
import pytest

from jckpt.services.jobs import Job
from jckpt.services.snapshot import Slot


def job_of(*arrays, seq=1):
    slot = Slot(0)
    leaves = [("jckpt", (("k", f"w{i}"),), a) for i, a in enumerate(arrays)]
    return Job(seq, slot, slot.take(leaves), {"note": "a"}, ("step", 7))


def test_a_job_drains_and_builds_its_entries_once():
    job = job_of(np.arange(3, dtype=np.float32), np.ones(2))
    assert job.items is job.items and job.built is job.built  # drained and hashed once
    entries, sources = job.built
    assert [e.name for e in entries] == ["jckpt/w0", "jckpt/w1"] and len(sources) == 2
    assert job.items[0].array.dtype == np.float32 and job.info == ("step", 7)


def test_release_lets_go_of_the_drained_leaves_so_the_slot_can_be_reused():
    job = job_of(np.ones(4))
    first = job.items
    job.release()
    assert "items" not in job.__dict__ and "built" not in job.__dict__
    assert job.items is not first and np.array_equal(job.items[0].array, first[0].array)


def test_a_job_is_frozen_and_compared_by_identity():
    job = job_of(np.ones(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.seq = 3
    twin = dataclasses.replace(job)
    assert twin != job and job == job  # a queue removes exactly the job it is given


def test_a_publisher_runs_its_calls_in_order_and_hands_back_each_outcome():
    from jckpt.services.jobs import Publisher
    p = Publisher("jckpt-test-publisher")
    seen = []

    def fails(x):
        raise OSError(x)
    futures = [p.call(seen.append, 1), p.call(fails, 5), p.call(seen.append, 2)]
    assert futures[2].result(timeout=20) is None and seen == [1, 2]
    assert isinstance(futures[1].exception(), OSError)  # a failed call stops none after it
    p.stop()
    p.thread.join(timeout=20)
    assert not p.thread.is_alive()
