"""A `CheckpointManager` whose directory is an S3 prefix, as a training job uses it, with the
requests it makes counted from the server's request log (`tests/s3server.py`)."""

import logging

import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError

TREE = {"w": np.arange(6, dtype=np.float32)}


def _saved(url, steps, **kw):
    with jckpt.CheckpointManager(url, **kw) as mgr:
        for step in steps:
            mgr.save(step, TREE, metrics={"loss": 1.0 / (step + 1)})


def _new(server, bucket, since):
    return server.requests(bucket)[since:]


def test_opening_a_manager_lists_its_prefix_once_and_reads_each_step_header_once(s3, s3_server):
    """Opening listed the prefix twice (once to clean up, once to find the steps) and read the
    latest step's header a second time, after a HEAD of a step record it could not have."""
    url = f"{s3}/run"
    _saved(url, range(1, 4))
    before = len(s3_server.requests(s3))
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2, 3] and mgr.metrics(2) == {"loss": 1 / 3}
        opened = _new(s3_server, s3, before)
    assert [r for r in opened if "list-type" in r] == ["GET ?delimiter=/&list-type=2&prefix=run/"], opened
    assert sorted(r for r in opened if r.startswith("GET /run/")) == [
        f"GET /run/step_0000000{s}.jckpt" for s in (1, 2, 3)], opened
    assert not [r for r in opened if r.startswith("HEAD")], opened
    assert len(opened) == 5, opened  # the lease's PUT, the LIST, a GET per step


def test_a_readers_reload_lists_the_prefix_and_reads_only_new_steps(s3, s3_server):
    """A read-only manager's `reload()` read every step's header again (a GET per step: 201
    requests for 200 steps with none new); the listing's ETags say which steps changed."""
    url = f"{s3}/run"
    _saved(url, range(1, 4))
    with jckpt.CheckpointManager(url, read_only=True) as reader:
        before = len(s3_server.requests(s3))
        assert reader.reload() == [1, 2, 3]
        assert _new(s3_server, s3, before) == ["GET ?delimiter=/&list-type=2&prefix=run/"]
        with jckpt.CheckpointManager(url) as writer:
            writer.save(4, TREE)
        before = len(s3_server.requests(s3))
        assert reader.reload() == [1, 2, 3, 4]
        assert _new(s3_server, s3, before) == ["GET ?delimiter=/&list-type=2&prefix=run/",
                                               "GET /run/step_00000004.jckpt"]


def test_retention_deletes_a_file_step_with_one_request(s3, s3_server):
    """Each removed step cost two LISTs (is it a prefix? what is under it?) before its DELETE."""
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url, keep_last=1, asynchronous=False) as mgr:
        mgr.save(1, TREE)
        before = len(s3_server.requests(s3))
        mgr.save(2, TREE)
        saved = _new(s3_server, s3, before)
    assert saved == ["PUT /run/step_00000002.jckpt", "POST ?delete"], saved
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [2]


def test_retention_deletes_many_file_steps_with_one_request(s3, s3_server):
    """A manager opened with a stricter policy deleted the steps it no longer keeps one DELETE
    each: 12 requests for 12 steps, now one multi-object DELETE per 1,000."""
    url = f"{s3}/run"
    _saved(url, range(1, 13))
    with jckpt.CheckpointManager(url, keep_last=1, asynchronous=False) as mgr:
        before = len(s3_server.requests(s3))
        mgr.save(13, TREE)
        saved = _new(s3_server, s3, before)
        assert mgr.all_steps() == [13]
    assert saved == ["PUT /run/step_00000013.jckpt", "POST ?delete"], saved
    assert jckpt.storage.backend_for(url).list(url) == ["step_00000013.jckpt"]


def test_retention_deletes_many_foreign_steps_with_three_requests(s3, s3_server):
    """Each step directory removed cost 4 requests (its index's and its record's DELETEs, a LIST
    and a DELETE of the rest): 20 for 5 steps, now 3 (the markers of all, one LIST from the first
    to the last, the rest of all), the markers first so that no step is seen half deleted."""
    url = f"{s3}/run"
    opts = jckpt.CheckpointOptions(format="npz")
    with jckpt.CheckpointManager(url, options=opts) as mgr:
        for step in range(1, 6):
            mgr.save(step, items={"model": TREE, "opt": {"m": TREE["w"]}})
    with jckpt.CheckpointManager(url, keep_last=1, options=opts, asynchronous=False) as mgr:
        before = len(s3_server.requests(s3))
        mgr.save(6, items={"model": TREE, "opt": {"m": TREE["w"]}})
        saved = _new(s3_server, s3, before)
        assert mgr.all_steps() == [6]
    assert [r for r in saved if not r.startswith("PUT ")] == [
        "POST ?delete", "GET ?list-type=2&prefix=run/&start-after=run/step_00000001.jckpt",
        "POST ?delete"], saved
    assert jckpt.storage.backend_for(url).list(url) == ["step_00000006.jckpt"]


def _failing_deletes(monkeypatch, calls):
    """obstore's `delete` fails at the calls numbered in `calls` (1 the first)."""
    import obstore

    real, seen = obstore.delete, []

    def delete(store, paths):
        seen.append(paths)
        if len(seen) in calls:
            raise ConnectionError("connection reset by peer")
        return real(store, paths)
    monkeypatch.setattr(obstore, "delete", delete)
    return seen


def test_a_failed_deletion_keeps_the_steps_known_and_is_tried_again(s3, monkeypatch, caplog):
    """Retention forgot a step before deleting it: one whose DELETE failed stayed in the bucket,
    unknown to the manager and never deleted by it."""
    url = f"{s3}/run"
    _saved(url, range(1, 4))
    with jckpt.CheckpointManager(url, keep_last=1, asynchronous=False) as mgr:
        _failing_deletes(monkeypatch, {1})
        with caplog.at_level(logging.WARNING):
            assert mgr.save(4, TREE)
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "retention" in warning and "connection reset" in warning
        assert "run/step_00000001.jckpt, run/step_00000002.jckpt, run/step_00000003.jckpt" in warning
        assert mgr.all_steps() == [1, 2, 3, 4] and mgr.latest_step() == 4
        np.testing.assert_array_equal(mgr.restore(2, target=TREE).tree["w"], TREE["w"])
        mgr.save(5, TREE)  # the next prune deletes them all
        assert mgr.all_steps() == [5]
    assert jckpt.storage.backend_for(url).list(url) == ["step_00000005.jckpt"]


def test_a_step_directory_whose_markers_are_gone_is_forgotten_and_its_rest_removed_later(
        s3, monkeypatch, caplog):
    url = f"{s3}/run"
    opts = jckpt.CheckpointOptions(format="npz")
    with jckpt.CheckpointManager(url, options=opts, keep_last=1, asynchronous=False) as mgr:
        mgr.save(1, items={"model": TREE, "opt": {"m": TREE["w"]}})
        _failing_deletes(monkeypatch, {2})  # the markers go, the model and optimizer stay
        with caplog.at_level(logging.WARNING):
            mgr.save(2, items={"model": TREE, "opt": {"m": TREE["w"]}})
        assert "run/step_00000001.jckpt/model.npz" in caplog.text
        assert mgr.all_steps() == [2]
        # what is left of it read as "a step whose save did not finish"
        with pytest.raises(jckpt.FormatError, match="no step 1: retention deleted it") as e:
            mgr.restore(1)
        assert "pick one of [2]" in e.value.fix
    monkeypatch.undo()
    backend = jckpt.storage.backend_for(url)
    assert backend.list(f"{url}/step_00000001.jckpt") == ["model.npz", "optimizer.jckpt"]
    with jckpt.CheckpointManager(url) as mgr:  # no step: removed as unfinished
        assert mgr.all_steps() == [2]
    assert backend.list(url) == ["step_00000002.jckpt"]


def test_restoring_the_latest_step_reads_its_header_once(s3, s3_server):
    """A restore asked whether the step exists (HEAD), whether it is a step directory (two HEADs),
    and read the header twice: 6 requests for a step that one GET holds whole."""
    url = f"{s3}/run"
    _saved(url, [5], keep_last=2)
    with jckpt.CheckpointManager(url) as mgr:
        mgr.restore(target={"w": np.zeros(6, np.float32)})  # the open's reader, used once
        before = len(s3_server.requests(s3))
        restored = mgr.restore(target={"w": np.zeros(6, np.float32)})
        asked = _new(s3_server, s3, before)
    np.testing.assert_array_equal(restored.tree["w"], TREE["w"])
    assert restored.metrics == {"loss": 1 / 6}
    assert asked == ["GET /run/step_00000005.jckpt"], asked


def test_opening_a_manager_of_step_directories_reads_one_record_per_step(s3, s3_server):
    """Each step directory cost two HEADs (is it published?), a HEAD of its record, a LIST and a
    HEAD before the record's GET: 14 requests to open 2 steps, now 4; its restore 14, now 3."""
    url = f"{s3}/run"
    opts = jckpt.CheckpointOptions(format="safetensors")
    with jckpt.CheckpointManager(url, options=opts, keep_last=2) as mgr:
        for step in range(1, 4):
            mgr.save(step, items={"model": TREE, "opt": {"m": TREE["w"]}})
    before = len(s3_server.requests(s3))
    with jckpt.CheckpointManager(url) as mgr:
        opened = _new(s3_server, s3, before)
        before = len(s3_server.requests(s3))
        back = mgr.restore()
        restored = _new(s3_server, s3, before)
    np.testing.assert_array_equal(back.tree["model"]["w"], TREE["w"])
    assert sorted(opened) == ["GET /run/step_00000002.jckpt/trainer_state.json",
                              "GET /run/step_00000003.jckpt/trainer_state.json",
                              "GET ?delimiter=/&list-type=2&prefix=run/", "PUT /run.jckpt-lease"]
    assert sorted(restored) == [f"GET /run/step_00000003.jckpt/{name}" for name in
                                ("model.safetensors", "optimizer.jckpt", "trainer_state.json")]


def _npz_writer(tree, path):
    np.savez(path, **tree)


@pytest.mark.parametrize("opts", [
    jckpt.CheckpointOptions(format="safetensors"), jckpt.CheckpointOptions(format="npz"),
    jckpt.CheckpointOptions(format="npz", model_writer=_npz_writer)], ids=["safetensors", "npz",
                                                                          "callback"])
def test_a_step_in_a_foreign_format_is_restored_with_one_get_per_file(s3, s3_server, opts):
    """The restore of a step whose model is in a foreign format read the step's record twice,
    asked with HEADs whether the model and the optimizer files are there, listed the model's
    name as a prefix, and read the model once to tell its format and again (an npz: twice more,
    for sniffers that read a zip's directory) to read it: 8 requests (10 for an npz), now 3."""
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url, options=opts) as mgr:
        mgr.save(1, items={"model": TREE, "opt": {"m": TREE["w"] * 2}}, trainer_state=jckpt.TrainerState(
            global_step=1))
    step = "/run/step_00000001.jckpt"
    model = f"GET {step}/{opts.model_file}"
    with jckpt.CheckpointManager(url) as mgr:
        before = len(s3_server.requests(s3))
        back = mgr.restore(target={"model": TREE, "opt": {"m": TREE["w"]}}, namespaces=["model", "opt"])
        restored = _new(s3_server, s3, before)
        before = len(s3_server.requests(s3))
        model_only = mgr.restore(target=TREE, ctx=jckpt.Context(namespace="model"))
        alone = _new(s3_server, s3, before)
    np.testing.assert_array_equal(back.tree["model"]["w"], TREE["w"])
    np.testing.assert_array_equal(back.tree["opt"]["m"], TREE["w"] * 2)
    assert back.trainer_state.global_step == 1
    np.testing.assert_array_equal(model_only.tree["w"], TREE["w"])
    assert sorted(restored) == sorted([f"GET {step}/trainer_state.json", model,
                                       f"GET {step}/optimizer.jckpt"]), restored
    assert sorted(alone) == sorted([f"GET {step}/trainer_state.json", model]), alone


def test_a_foreign_step_whose_optimizer_file_is_gone_restores_its_model(s3):
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url, options=jckpt.CheckpointOptions(format="npz")) as mgr:
        mgr.save(1, items={"model": TREE, "opt": {"m": TREE["w"]}})
    jckpt.storage.backend_for(url).remove(f"{url}/step_00000001.jckpt/optimizer.jckpt", below=False)
    with jckpt.CheckpointManager(url) as mgr:
        assert list(mgr.restore().tree) == ["model"]
        with pytest.raises(jckpt.MissingEntryError, match="no namespace 'opt'"):
            mgr.restore(namespaces=["opt"])


def test_a_foreign_step_whose_model_file_is_gone_is_an_error_naming_it(s3):
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url, options=jckpt.CheckpointOptions(format="npz")) as mgr:
        mgr.save(1, items={"model": TREE, "opt": {"m": TREE["w"]}})
    model = f"{url}/step_00000001.jckpt/model.npz"
    jckpt.storage.backend_for(url).remove(model, below=False)
    with jckpt.CheckpointManager(url) as mgr, pytest.raises(jckpt.FormatError,
                                                            match="step 1 has no model file") as e:
        mgr.restore()
    assert e.value.file == model


def test_a_directory_step_is_opened_and_restored_without_asking_what_it_is(s3, s3_server):
    """A directory checkpoint step cost 7 requests to open and 13 to restore (HEADs of its record
    and index, a failed GET of the step as an object, LISTs), now 2 and 3 (4 while the restore
    asked for a record the manager's listing had found none of)."""
    url = f"{s3}/run"
    step = "/run/step_00000001.jckpt"
    with jckpt.CheckpointManager(url, directory_steps=True) as mgr:
        mgr.save(1, TREE, metrics={"loss": 0.5})
        before = len(s3_server.requests(s3))
        mgr.restore(target={"w": np.zeros(6, np.float32)})  # a step it saved: no record asked for
        saved_then_restored = _new(s3_server, s3, before)
    assert saved_then_restored[0] == f"GET {step}/index.jckpt", saved_then_restored
    assert len(saved_then_restored) == 3, saved_then_restored
    before = len(s3_server.requests(s3))
    with jckpt.CheckpointManager(url) as mgr:
        opened = _new(s3_server, s3, before)
        assert mgr.metrics(1) == {"loss": 0.5}
        before = len(s3_server.requests(s3))
        back = mgr.restore(target={"w": np.zeros(6, np.float32)})
        restored = _new(s3_server, s3, before)
    np.testing.assert_array_equal(back.tree["w"], TREE["w"])
    assert opened[2:] == [f"GET {step}/trainer_state.json", f"GET {step}/index.jckpt"], opened
    assert restored[:2] == [f"GET {step}/index.jckpt",
                            f"GET ?delimiter=/&list-type=2&prefix={step[1:]}/"], restored
    assert len(restored) == 3 and restored[2].startswith(f"GET {step}/process_00000."), restored


def test_an_unfinished_step_prefix_is_removed_when_a_manager_opens(s3):
    url = f"{s3}/run"
    _saved(url, [1])
    backend = jckpt.storage.backend_for(url)
    with backend.create(f"{url}/step_00000002.jckpt/process_00000.jckpt") as staged:  # no index
        import os
        os.write(staged.fd, b"piece")
        staged.publish()
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1]
    assert backend.list(url) == ["step_00000001.jckpt"]


def test_a_step_removed_behind_the_managers_back_is_an_error_naming_it(s3):
    url = f"{s3}/run"
    _saved(url, [1, 2])
    with jckpt.CheckpointManager(url) as mgr:
        jckpt.storage.backend_for(url).remove(f"{url}/step_00000001.jckpt")
        with pytest.raises(jckpt.FormatError, match="no step 1") as e:
            mgr.restore(1, target=TREE)
        assert e.value.file == f"{url}/step_00000001.jckpt" and "open the manager again" in e.value.fix


def test_a_manager_of_a_prefix_that_is_a_checkpoint_object_is_refused(s3, caplog):
    """A manager pointed at a checkpoint file's URL opened, found no steps, and saved its steps
    under the file's name as a prefix, where a local manager refuses a file in the way."""
    url = f"{s3}/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    with pytest.raises(InputError, match="is an object, not a directory of steps") as e:
        jckpt.CheckpointManager(url)
    assert e.value.file == url and "another URL" in e.value.fix
    with jckpt.CheckpointManager(f"{s3}/run") as mgr:  # the lease object beside it is no step file
        assert mgr.all_steps() == []


def test_opening_a_manager_reads_the_step_headers_concurrently(s3, s3_server, monkeypatch):
    """Resuming a run of 1,105 steps read their headers one after another: 5.7 s on moto."""
    import threading

    from jckpt.storage import object_store
    url = f"{s3}/run"
    _saved(url, range(8))
    seen, lock = set(), threading.Lock()
    real = object_store.ObjectSource.head
    gate = threading.Barrier(2, timeout=5)

    def head(self, length):
        with lock:
            seen.add(threading.get_ident())
        if self.u.key.endswith(("step_00000000.jckpt", "step_00000001.jckpt")):
            gate.wait()  # both first GETs in flight at once, or this times out
        return real(self, length)
    monkeypatch.setattr(object_store.ObjectSource, "head", head)
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == list(range(8))
    assert len(seen) > 1 and not gate.broken


def test_restoring_a_step_whose_header_is_long_reads_it_in_one_get(s3, s3_server):
    """A header past the first GET's 64 KiB took a second GET, sent once the first was
    answered, at each restore of a step: the first GET now asks for as much as the headers
    the manager read as it opened."""
    url = f"{s3}/run"
    tree = {f"k{i:04d}": np.float32(i) for i in range(1200)}  # a header of some 100 KiB
    with jckpt.CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, tree)
    with jckpt.CheckpointManager(url, read_only=True) as mgr:  # it reads the step again
        before = len(s3_server.requests(s3))
        restored = mgr.restore(2, target=tree)
        asked = _new(s3_server, s3, before)
    assert restored.tree["k1199"] == 1199
    assert asked == ["GET /run/step_00000002.jckpt"], asked


def test_a_job_resuming_restores_its_latest_step_with_no_request_more_than_its_open(s3, s3_server):
    """Opening a manager read the latest step's header, and resuming from that step read it
    again: one GET more, in turn, on every resume. A small step now costs nothing more; a
    large one only the GETs of what its open's GET did not bring."""
    url = f"{s3}/run"
    _saved(url, [1, 2])
    with jckpt.CheckpointManager(url) as mgr:
        before = len(s3_server.requests(s3))
        restored = mgr.restore(target={"w": np.zeros(6, np.float32)})
        assert _new(s3_server, s3, before) == []
        again = mgr.restore(target={"w": np.zeros(6, np.float32)})  # the reader was used once
        assert _new(s3_server, s3, before) == ["GET /run/step_00000002.jckpt"]
    np.testing.assert_array_equal(restored.tree["w"], TREE["w"])
    np.testing.assert_array_equal(again.tree["w"], TREE["w"])
    assert restored.step == 2 and restored.metrics == {"loss": 1 / 3}
    big = {"w": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB, past the open's 64 KiB GET
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(3, big)
    with jckpt.CheckpointManager(url) as mgr:
        before = len(s3_server.requests(s3))
        np.testing.assert_array_equal(mgr.restore(target=big).tree["w"], big["w"])
        assert _new(s3_server, s3, before) == ["GET /run/step_00000003.jckpt"]  # the payload's


def test_opening_a_manager_reads_as_many_step_headers_at_once_as_the_store_allows(slow_s3):
    """The step headers were read 8 at a time whatever the store's `concurrency`: a bucket
    configured for 2 requests in flight got 8, one configured for 12 waited on 2 rounds."""
    from jckpt.storage import object_store

    s3, proxy = slow_s3
    url = f"{s3}/run"
    proxy.delay = 0
    _saved(url, range(12))
    proxy.delay = 0.05
    most = {}
    for limit in (2, 12):
        object_store.configure(s3, endpoint=proxy.endpoint, concurrency=limit)
        proxy.reset_counts()
        with jckpt.CheckpointManager(url, read_only=True) as mgr:
            assert mgr.all_steps() == list(range(12))
        assert len([p for m, p in proxy.seen if m == "GET" and "/run/step_" in p]) == 12, proxy.seen
        most[limit] = proxy.most_in_flight
    assert most[2] == 2 and most[12] > 8, most


def test_a_manager_that_cannot_read_its_steps_stops_asking_at_the_first_refusal(slow_s3):
    """The open failed on the first step the store refused, but only once every step had been
    asked: a bucket of 1,000 steps that refused them all was asked 1,000 times first."""
    import datetime

    from jckpt.storage import object_store

    s3, proxy = slow_s3
    url = f"{s3}/run"
    proxy.delay = 0
    _saved(url, range(20))
    proxy.fault = lambda method, path, headers: "503" if "/run/step_" in path else None
    object_store.configure(s3, endpoint=proxy.endpoint, concurrency=2, retry_config={
        "max_retries": 0, "retry_timeout": datetime.timedelta(seconds=5)})
    proxy.reset_counts()
    with pytest.raises(jckpt.StorageError, match="503"):
        jckpt.CheckpointManager(url, read_only=True)
    asked = [p for m, p in proxy.seen if m == "GET" and "/run/step_" in p]  # (each failure: HEADs)
    assert len(asked) <= 2, proxy.seen


def test_a_training_job_resumes_from_a_bucket_with_best_n_and_foreign_steps(s3, caplog):
    url = f"{s3}/run"
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.7}
    opts = jckpt.CheckpointOptions(format="safetensors")
    with jckpt.CheckpointManager(url, keep_last=1, keep_best=2, best_metric="loss", options=opts) as mgr:
        for step, loss in losses.items():
            mgr.save(step, items={"model": TREE, "opt": {"m": TREE["w"] * step}}, metrics={"loss": loss})
    with caplog.at_level(logging.WARNING), \
            jckpt.CheckpointManager(url, keep_last=1, keep_best=2, best_metric="loss") as mgr:
        assert mgr.all_steps() == [2, 4, 5] and mgr.best_step() == 2
        back = mgr.restore(4)
        np.testing.assert_array_equal(back.tree["opt"]["m"], TREE["w"] * 4)
        mgr.save(6, {"w": TREE["w"]}, metrics={"loss": 0.05})  # a jckpt step after foreign ones
        mgr.wait_durable()
        assert mgr.all_steps() == [2, 6] and mgr.best_step() == 6
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [2, 6]
        assert mgr.restore(2).metrics == {"loss": 0.1}


#: A training job that saves step 1, then is killed while step 2's multipart upload runs
#: (its upload stalls after the first 5 MiB part).
TRAINER = """
import sys, time
import numpy as np, obstore
import jckpt
from jckpt.storage import object_store

url = sys.argv[1]
object_store.configure(url.rsplit("/", 1)[0], part_size=5 << 20, concurrency=1)
put = obstore.put

def stalling_put(store, key, data, **kw):
    if not key.endswith("step_00000002.jckpt"):
        return put(store, key, data, **kw)
    def parts():  # the manager uploads the step's staged local file
        sent = 0
        for chunk in iter(lambda: f.read(1 << 20), b""):
            yield chunk
            sent += memoryview(chunk).nbytes
            if sent > 6 << 20:
                time.sleep(3600)
    f = open(data, "rb")
    return put(store, key, parts(), **kw)

obstore.put = stalling_put
mgr = jckpt.CheckpointManager(url, keep_last=2)
mgr.save(1, {"w": np.full(4, 1, np.float32)}, metrics={"loss": 1.0})
mgr.wait_durable()
mgr.save(2, {"w": np.full(3 << 20, 2, np.float32)}, metrics={"loss": 0.5})
mgr.wait_durable()
"""


@pytest.mark.slow
def test_a_training_job_killed_mid_upload_resumes_from_its_last_step(s3):
    """The next manager takes over the dead job's lease at once (same host), aborts the step
    upload it left, and resumes from step 1, which is whole."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.s3server import markers_of, uploads_of
    url = f"{s3}/run"
    step2 = f"{url}/step_00000002.jckpt"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, url], cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        while not uploads_of(step2):
            assert proc.poll() is None, "the job exited before its step 2 upload started"
            assert time.monotonic() < deadline, "the step 2 upload did not start within 120 s"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert markers_of(step2)
    with jckpt.CheckpointManager(url, keep_last=2) as mgr:
        assert mgr.all_steps() == [1] and uploads_of(step2) == [] and markers_of(step2) == []
        np.testing.assert_array_equal(mgr.restore(target={"w": np.zeros(4, np.float32)}).tree["w"], 1)
        mgr.save(2, TREE, metrics={"loss": 0.5})
    with jckpt.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1, 2] and mgr.metrics(2) == {"loss": 0.5}


def test_keys_with_spaces_signs_and_unicode_round_trip(s3):
    names = ["run with space", "a+b%20c#d?e&f;g", "ünï cödé 日本 😀"]
    for name in names:
        url = f"{s3}/{name}"
        _saved(url, [1, 2], keep_last=1)
        with jckpt.CheckpointManager(url) as mgr:
            assert mgr.all_steps() == [2]
            np.testing.assert_array_equal(mgr.restore(target=TREE).tree["w"], TREE["w"])
        assert jckpt.verify(url).ok
    listed = {o["Key"].split("/")[0] for o in _client_objects(s3)}
    assert listed == set(names), listed  # each key stored as written, none encoded twice


def _client_objects(s3):
    from tests.s3server import client
    return client(s3).list_objects_v2(Bucket=s3.removeprefix("s3://"))["Contents"]


def test_a_manager_on_a_bucket_that_does_not_exist_names_the_bucket_and_its_directory(s3):
    """The error named the lease object beside the directory, not the directory, nor the bucket."""
    url = "s3://no-such-bucket-for-a-manager/run"
    with pytest.raises(jckpt.StorageError, match="the bucket 'no-such-bucket-for-a-manager' "
                                                 "does not exist") as e:
        jckpt.CheckpointManager(url)
    assert e.value.file == url
    assert "create the bucket (aws s3 mb s3://no-such-bucket-for-a-manager)" in e.value.fix
    assert "AWS_ENDPOINT_URL" in e.value.fix and "credentials" in e.value.fix


def test_a_step_saved_since_the_manager_listed_is_restored_without_asking_what_it_is(s3, s3_server):
    """A step the manager had not listed was looked up first (HEADs of the step and of its
    record, a LIST) and its header read twice: 5 requests for a file step that one GET holds,
    13 for a directory checkpoint, 7 for a step directory; now 1, 5 and 3."""
    import obstore

    from jckpt.storage.object_store import ObjectURL, store_for
    src, url = f"{s3}/elsewhere", f"{s3}/run"
    _saved(src, [1])
    _saved(src, [2], directory_steps=True)
    _saved(src, [3], options=jckpt.CheckpointOptions(format="npz"))
    with jckpt.CheckpointManager(url) as mgr:
        store = store_for(ObjectURL.parse(src))  # the steps arrive after the manager listed
        for chunk in obstore.list(store, prefix="elsewhere/"):
            for o in chunk:
                obstore.copy(store, o["path"], "run/" + o["path"].removeprefix("elsewhere/"))
        counts = {}
        for step in (1, 2, 3):
            before = len(s3_server.requests(s3))
            got = mgr.restore(step, target={"w": np.zeros(6, np.float32)})
            np.testing.assert_array_equal(got.tree["w"], TREE["w"])
            counts[step] = _new(s3_server, s3, before)
        with pytest.raises(jckpt.FormatError, match="no step 4") as e:
            mgr.restore(4, target=TREE)
        assert e.value.file == url and "pick one of" in e.value.fix
    step = "/run/step_0000000{}.jckpt"
    assert counts[1] == [f"GET {step.format(1)}"], counts
    assert counts[2][:3] == [f"GET {step.format(2)}", f"GET {step.format(2)}/trainer_state.json",
                             f"GET {step.format(2)}/index.jckpt"] and len(counts[2]) == 5, counts
    assert counts[3] == [f"GET {step.format(3)}", f"GET {step.format(3)}/trainer_state.json",
                         f"GET {step.format(3)}/model.npz"], counts
    assert not [r for rs in counts.values() for r in rs if r.startswith("HEAD")], counts


def test_a_step_prefix_saved_since_that_did_not_finish_is_an_error_naming_it(s3):
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url) as mgr:
        with jckpt.storage.backend_for(url).create(
                f"{url}/step_00000002.jckpt/process_00000.jckpt") as staged:  # no index
            import os
            os.write(staged.fd, b"piece")
            staged.publish()
        with pytest.raises(jckpt.FormatError, match="did not finish") as e:
            mgr.restore(2, target=TREE)
        assert e.value.file == f"{url}/step_00000002.jckpt"


@pytest.mark.parametrize("directory_steps, opts", [(True, None), (False, "safetensors")])
def test_a_reader_lists_again_when_the_step_prefixes_it_listed_were_removed(s3, monkeypatch, caplog,
                                                                           directory_steps, opts):
    """A reader listed step prefixes (directory checkpoints, step directories) that the
    writer's retention removed before they were read: they read as unfinished saves and were
    left out without listing again, so the reader found no step though the run had two. A
    prefix that still holds what a save left (no index, no record) stays unfinished, listed once."""
    from jckpt.format.names import step_name
    from jckpt.services import steps

    url = f"{s3}/run"
    kw = {"directory_steps": True} if directory_steps else {
        "options": jckpt.CheckpointOptions(format=opts)}
    _saved(url, [0, 1], **kw)
    backend = jckpt.storage.backend_for(url)
    stale = steps.listed(backend, url)  # made before the writer moved on
    _saved(url, [2, 3], keep_last=2, **kw)
    with backend.create(f"{url}/{step_name(4)}/process_00000.jckpt") as staged:  # a save under way
        import os
        os.write(staged.fd, b"piece")
        staged.publish()
    real, calls = steps.listed, []

    def listed(backend, directory):
        calls.append(directory)
        return stale if len(calls) == 1 else real(backend, directory)
    monkeypatch.setattr(steps, "listed", listed)
    with caplog.at_level(logging.WARNING, logger="jckpt"):
        with jckpt.CheckpointManager(url, read_only=True) as reader:
            assert reader.all_steps() == [2, 3] and reader.restore().step == 3
    assert len(calls) == 2 and "unreadable" not in caplog.text
    found = steps.scan(backend, url, real(backend, url))
    assert found.unfinished == (step_name(4),) and found.vanished == ()
    marker = "index.jckpt" if directory_steps else "trainer_state.json"
    with backend.create(f"{url}/{step_name(3)}/{marker}") as damaged:  # unreadable, not removed
        os.write(damaged.fd, b"garbage")
        damaged.publish()
    found = steps.scan(backend, url, real(backend, url))
    assert sorted(found.metrics) == [2] and found.vanished == () and "unreadable step" in caplog.text


def test_a_manager_that_may_not_read_its_steps_fails_to_open_and_saves_over_none():
    """Credentials without s3:GetObject (or a store failing through its retries) made every
    step "unreadable", logged and left out: the manager opened on no step, and a job that
    resumed from none saved step 1 over the published one."""
    import json

    import boto3

    from jckpt.storage import object_store
    from tests.s3server import S3Server

    server = S3Server.start(env={"INITIAL_NO_AUTH_ACTION_COUNT": "7"})  # then policies apply

    def client(service, **keys):
        return boto3.client(service, endpoint_url=server.endpoint, region_name="us-east-1",
                            **(keys or {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}))

    def user(name, actions):
        iam = client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"]}

    try:
        writer = user("writer", ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"])
        blind = user("blind", ["s3:PutObject", "s3:DeleteObject", "s3:ListBucket"])
        client("s3").create_bucket(Bucket="steps")
        object_store.configure("s3://steps", endpoint=server.endpoint, region="us-east-1", **writer)
        _saved("s3://steps/run", [1, 2])
        object_store.configure("s3://steps", endpoint=server.endpoint, region="us-east-1", **blind)
        for read_only in (False, True):
            with pytest.raises(jckpt.StorageError, match="access denied") as e:
                jckpt.CheckpointManager("s3://steps/run", read_only=read_only)
            assert e.value.file.startswith("s3://steps/run/step_0000000") and "s3:GetObject" in e.value.fix
        object_store.configure("s3://steps", endpoint=server.endpoint, region="us-east-1", **writer)
        with jckpt.CheckpointManager("s3://steps/run", read_only=True) as reader:
            assert reader.all_steps() == [1, 2] and reader.restore(2, TREE).step == 2
    finally:
        object_store.configure("s3://steps")
        server.stop()
