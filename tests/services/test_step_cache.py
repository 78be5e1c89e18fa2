"""What a reader keeps of each step it read: kept while the step's file is the same, no more
than the steps listed, the latest step's header alone."""

import os

import numpy as np

import jckpt
from jckpt.format.names import step_name
from jckpt.services import step_removal, steps
from jckpt.services.step_cache import DROPPED, StepCache, file_key
from jckpt.storage.backend import LOCAL


def saved(directory, *numbers, fmt="jckpt"):
    with jckpt.CheckpointManager(directory, options=jckpt.CheckpointOptions(format=fmt),
                                 new_lineage=True) as mgr:
        for step in numbers:
            mgr.save(step, {"w": np.full(3, step, np.float32)}, metrics={"loss": 0.5})
    return [os.path.join(directory, step_name(step)) for step in numbers]


def test_a_key_changes_when_the_step_is_replaced_and_not_otherwise(tmp_path):
    file_step, = saved(tmp_path / "a", 1)
    folder_step, = saved(tmp_path / "a", 2, fmt="safetensors")
    keys = file_key(file_step), file_key(folder_step)
    assert None not in keys and keys == (file_key(file_step), file_key(folder_step))
    other, = saved(tmp_path / "b", 1)
    os.replace(other, file_step)  # an atomic rename over it
    assert file_key(file_step) != keys[0]
    os.remove(os.path.join(folder_step, "trainer_state.json"))  # no record: no step to keep
    assert file_key(folder_step) is None and file_key(str(tmp_path / "none")) is None


def test_what_is_kept_is_given_back_for_its_key_alone():
    cache = StepCache()
    cache.put("s1", (1, 2), ({"a": "1"}, None))
    assert cache.get("s1", (1, 2)) == ({"a": "1"}, None)
    assert cache.get("s1", (1, 3)) is None and cache.get("s1", None) is None
    assert cache.get("s2", (1, 2)) is None
    cache.put("s1", None, ({}, None))  # no key: forgotten
    assert len(cache) == 0


def test_keep_holds_the_listed_steps_and_the_latest_header_only():
    cache, header = StepCache(), object()
    for n in (1, 2, 3):
        cache.put(f"s{n}", (n,), ({"n": str(n)}, header))
    latest = cache.keep({2: ("s2", ({}, header)), 3: ("s3", ({}, header))})
    assert latest == ("s3", ({}, header)) and len(cache) == 2
    assert cache.get("s2", (2,)) == ({"n": "2"}, DROPPED) and cache.get("s3", (3,))[1] is header
    assert cache.keep({2: ("s2", cache.get("s2", (2,)))}) is None  # its header let go: read again
    assert cache.keep({}) is None and len(cache) == 0


def test_a_scan_through_a_cache_reads_each_step_once_and_lists_the_same(tmp_path, monkeypatch):
    saved(tmp_path, 1, 2)
    saved(tmp_path, 3, fmt="safetensors")
    cache, read, reads = StepCache(), steps._read_step, []
    monkeypatch.setattr(steps, "_read_step", lambda path, *a: reads.append(path) or read(path, *a))
    first = steps.scan(LOCAL, str(tmp_path), cache=cache)
    again = steps.scan(LOCAL, str(tmp_path), cache=cache)
    assert len(reads) == 3 and again == first == steps.scan(LOCAL, str(tmp_path))
    step_removal.remove_step(LOCAL, str(tmp_path / step_name(3)))
    del reads[:]
    found = steps.scan(LOCAL, str(tmp_path), cache=cache)
    assert sorted(found.metrics) == [1, 2] and len(cache) == 2
    assert found.latest is None and reads == []  # step 2's header was let go
    meta, digest = steps.described(str(tmp_path / step_name(2)), found.latest)
    assert meta["jckpt.step"] == "2" and digest is not None


def test_a_bucket_step_is_kept_while_its_listed_version_is_the_same(monkeypatch):
    # a step in a bucket was never kept: each reload read every step's header again
    import obstore

    from jckpt.storage.object_store import ObjectSource, ObjectURL, store_for

    url = "memory://step-cache-versions/run"
    saved(url, 1, 2, 3)
    reads = []
    real = ObjectSource.head
    monkeypatch.setattr(ObjectSource, "head", lambda src, n: reads.append(src.u.key) or real(src, n))
    with jckpt.CheckpointManager(url, read_only=True) as reader:
        assert len(reads) == 3
        assert reader.reload() == [1, 2, 3] and len(reads) == 3  # nothing new: nothing read
        one, two = ObjectURL.parse(f"{url}/{step_name(1)}"), ObjectURL.parse(f"{url}/{step_name(2)}")
        store = store_for(two)
        obstore.put(store, two.key, bytes(obstore.get(store, one.key).bytes()))  # step 2 replaced
        reader.reload()
        assert reads[3:] == [two.key]  # the step replaced, alone
