"""A read-only `CheckpointManager` (`read_only=True`): an evaluation job following a live run
in the same directory, locally, in memory and in an S3 bucket, while the run's own manager
writes, prunes and holds the lease."""

import itertools
import os

import numpy as np
import pytest

import jckpt
from jckpt.format.names import step_name
from jckpt.services import formats
from jckpt.storage import staging
from jckpt.storage.backend import backend_for

TREE = {"w": np.arange(6, dtype=np.float32)}
_MEMORY = itertools.count()


def at(step):
    return {"w": np.full(6, step, np.float32)}


def listing(directory):
    """Every name under `directory`, to show that a reader changed nothing there."""
    if "://" not in directory:
        return sorted(os.path.relpath(os.path.join(d, n), directory)
                      for d, dirs, files in os.walk(directory) for n in dirs + files)
    return sorted(backend_for(directory).list(directory))


@pytest.fixture(params=["local", "memory", "s3"])
def where(request, tmp_path):
    """A run's directory: local, `memory://`, or a bucket on the test S3 server."""
    if request.param == "local":
        return str(tmp_path / "run")
    if request.param == "memory":
        return f"memory://read-only-{next(_MEMORY)}/run"
    return f"{request.getfixturevalue('s3')}/run"


@pytest.mark.parametrize("fmt", ["jckpt", "safetensors", "torch"])
def test_a_reader_follows_a_live_run_and_never_sees_a_step_being_written(where, fmt, monkeypatch):
    """A second manager on a training run's directory was refused with InUseError, and a step
    in another format (model.safetensors) could be read through a manager only."""
    options = jckpt.CheckpointOptions(format=fmt)
    seen_while_written = []
    finish_file, finish_step = staging.finish_staged, formats.finish_step

    def finishing(finish):
        def finished(temporary, target, **kw):  # the step is staged, not yet published
            seen_while_written.append((os.path.basename(target), reader.reload()))
            return finish(temporary, target, **kw)
        return finished

    with jckpt.CheckpointManager(where, keep_last=2, options=options, asynchronous=False) as run:
        for step in (1, 2):
            run.save(step, at(step), metrics={"loss": 1.0 / step},
                     trainer_state=jckpt.TrainerState(global_step=step))
        before = listing(where)
        reader = jckpt.CheckpointManager(where, read_only=True)
        assert listing(where) == before  # no lease, nothing created or removed
        assert reader.all_steps() == [1, 2] and reader.latest_step() == 2
        assert reader.best_step("loss", "max") == 1 and reader.metrics(2) == {"loss": 0.5}
        assert reader.lineage == run.lineage
        got = reader.restore(target=at(0))
        assert got.step == 2 and got.trainer_state.global_step == 2
        np.testing.assert_array_equal(got.tree["w"], at(2)["w"])

        monkeypatch.setattr(staging, "finish_staged", finishing(finish_file))
        monkeypatch.setattr(formats, "finish_step", finishing(finish_step))
        run.save(3, at(3), metrics={"loss": 1 / 3})  # retention removes step 1
        monkeypatch.undo()
        assert seen_while_written == [("step_00000003.jckpt", [1, 2])]  # not the step being written
        assert reader.all_steps() == [1, 2]  # the listing as of the last reload
        with pytest.raises(jckpt.FormatError, match="no step 1") as gone:
            reader.restore(1, target=at(0))
        assert "reload()" in gone.value.fix
        assert reader.reload() == [2, 3] and reader.restore().step == 3
        got = reader.restore(3, target=at(0))
        np.testing.assert_array_equal(got.tree["w"], at(3)["w"])
        reader.close()
        reader.close()  # idempotent, and the run writes on
        run.save(4, at(4))
    assert reader.reload() == [3, 4]


def test_a_reader_writes_nothing_and_says_so(where):
    with jckpt.CheckpointManager(where) as run:
        run.save(1, TREE)
    with jckpt.CheckpointManager(where, read_only=True) as reader:
        for write in (lambda: reader.save(2, TREE), lambda: reader.save(2, TREE, force=True),
                      lambda: reader.should_save(2)):
            with pytest.raises(jckpt.InputError, match="read-only") as e:
                write()
            assert e.value.file == where and "read_only=True" in e.value.fix
        assert reader.wait_durable() and str(reader.counters).endswith("pending 0 error 0")
    for writer_only in ({"keep_last": 2}, {"keep_best": 1, "best_metric": "loss"},
                        {"new_lineage": True}, {"handle_sigterm": True}):
        with pytest.raises(jckpt.InputError, match=f"{next(iter(writer_only))}: the manager is read-only"):
            jckpt.CheckpointManager(where, read_only=True, **writer_only)
    with jckpt.CheckpointManager(where) as run, pytest.raises(jckpt.InputError, match="reload"):
        run.reload()  # a writer's listing is its own
    with pytest.raises(jckpt.InputError, match="read_only must be"):
        jckpt.CheckpointManager(where, read_only="yes")


def test_a_reader_leaves_what_a_killed_writer_left_and_lists_only_published_steps(where):
    with jckpt.CheckpointManager(where) as run:
        run.save(1, TREE)
    backend = backend_for(where)
    unfinished = f"{where}/step_00000002.jckpt"  # a directory step whose save died: no index
    if "://" in where:
        with backend.create(f"{unfinished}/process_00000.jckpt") as staged:
            os.write(staged.fd, b"piece")
            staged.publish()
    else:
        os.makedirs(unfinished)
        with open(f"{unfinished}/process_00000.jckpt", "wb") as f:
            f.write(b"piece")
        with open(staging.next_name(f"{where}/step_00000003.jckpt", 7), "wb") as f:
            f.write(b"staged")  # a file step's staging
    before = listing(where)
    with jckpt.CheckpointManager(where, read_only=True) as reader:
        assert reader.all_steps() == [1] and reader.reload() == [1]
    assert listing(where) == before
    with jckpt.CheckpointManager(where) as run:  # the writer cleans up, as before
        assert run.all_steps() == [1]
    assert listing(where) != before


def test_a_reader_of_a_directory_that_is_not_there_is_refused_and_creates_it_not(tmp_path):
    with pytest.raises(jckpt.FormatError, match="no such directory") as e:
        jckpt.CheckpointManager(tmp_path / "typo", read_only=True)
    assert e.value.file == str(tmp_path / "typo") and not os.path.exists(tmp_path / "typo")


def test_a_reader_checks_the_lineage_it_is_given_at_each_reload(tmp_path):
    with jckpt.CheckpointManager(tmp_path, lineage="run-a") as run:
        run.save(1, TREE)
    reader = jckpt.CheckpointManager(tmp_path, read_only=True, lineage="run-a")
    assert reader.lineage == "run-a"
    with pytest.raises(jckpt.LineageError, match="run-a"):
        jckpt.CheckpointManager(tmp_path, read_only=True, lineage="run-b")
    with jckpt.CheckpointManager(tmp_path, lineage="run-b", new_lineage=True) as run:
        run.save(2, TREE)
    with pytest.raises(jckpt.LineageError, match="run-b"):
        reader.reload()  # the directory went on with another run


@pytest.mark.parametrize("options,items", [
    ({"directory_steps": True}, False),
    ({"options": jckpt.CheckpointOptions(format="npz")}, False),  # the model file goes
    ({"options": jckpt.CheckpointOptions(format="npz")}, True)])  # so does the optimizer's
def test_a_step_removed_while_a_reader_restores_it_is_an_error_that_says_so(
        where, monkeypatch, options, items):
    """A step directory the run's retention removed between the reader's read of its record
    (or index) and of its arrays was a StorageError saying to create the directory (locally),
    or the error of its missing model file (in a bucket)."""
    from jckpt.services import step_removal, steps

    with jckpt.CheckpointManager(where, **options) as run:
        for step in (1, 2):
            run.save(step, **({"items": {"model": TREE, "opt": TREE}} if items else {"tree": TREE}))
    reader = jckpt.CheckpointManager(where, read_only=True)
    assert reader.all_steps() == [1, 2]
    read_tree, first = steps.read_tree, f"{where}/step_00000001.jckpt"

    def removed_meanwhile(*args, **kw):
        step_removal.remove_step(backend_for(where), first)
        return read_tree(*args, **kw)

    monkeypatch.setattr(steps, "read_tree", removed_meanwhile)
    asked = {"namespaces": ["opt"], "target": {"opt": TREE}} if items else {"target": TREE}
    with pytest.raises(jckpt.FormatError, match="no step 1: it was removed since") as e:
        reader.restore(1, **asked)
    assert e.value.file == first and "reload()" in e.value.fix
    monkeypatch.undo()
    assert reader.reload() == [2]
    got = reader.restore(**asked).tree
    np.testing.assert_array_equal((got["opt"] if items else got)["w"], TREE["w"])


def test_a_reader_follows_an_asynchronous_run_step_by_step(where):
    """The evaluation loop: after each of the run's saves (in flight, retention behind it),
    reload and restore the newest step; each step read is one the run saved, whole."""
    evaluated = []
    with jckpt.CheckpointManager(where, keep_last=2) as run:
        run.save(0, at(0))
        run.wait_durable()
        with jckpt.CheckpointManager(where, read_only=True) as reader:
            for step in range(1, 9):
                run.save(step, at(step), metrics={"loss": 1.0 / step})
                listed = reader.reload()
                assert listed == sorted(listed) and set(listed) <= set(range(step + 1))
                try:
                    got = reader.restore(target=at(-1))
                except jckpt.FormatError as e:  # retention went past it meanwhile
                    assert "it was removed since the manager listed its steps" in e.message
                    continue
                np.testing.assert_array_equal(got.tree["w"], at(got.step)["w"])
                evaluated.append(got.step)
            run.wait_durable()
            assert reader.reload() == [7, 8] and reader.restore().step == 8
    assert evaluated == sorted(evaluated) and evaluated


def counting_reads(monkeypatch):
    """The names of the steps whose metadata a manager reads (a header or record decoded)."""
    from jckpt.services import steps
    read, names = steps._read_step, []

    def counted(path, *args):
        names.append(os.path.basename(path))
        return read(path, *args)
    monkeypatch.setattr(steps, "_read_step", counted)
    return names


@pytest.mark.parametrize("fmt", ["jckpt", "safetensors"])
def test_a_reload_reads_only_the_steps_published_since(tmp_path, fmt, monkeypatch):
    """Each reload decoded every step's header (or record) again: a reader polling a long
    run's directory paid for its whole history at each poll."""
    options = jckpt.CheckpointOptions(format=fmt)
    with jckpt.CheckpointManager(tmp_path, options=options, keep_last=3, asynchronous=False) as run:
        for step in (1, 2, 3):
            run.save(step, at(step), metrics={"loss": 1.0 / step})
        reads = counting_reads(monkeypatch)
        with jckpt.CheckpointManager(tmp_path, read_only=True) as reader:
            assert len(reads) == 3  # the open reads them all
            del reads[:]
            assert reader.reload() == [1, 2, 3] and reads == []
            run.save(4, at(4), metrics={"loss": 0.25})  # retention removes step 1
            assert reader.reload() == [2, 3, 4] and reads == [step_name(4)]
            assert reader.metrics(4) == {"loss": 0.25} and reader.best_step("loss") == 4
            assert reader.restore().step == 4
            assert len(reader._step_cache) == 3  # no more than the steps listed


def replaced(directory, step, metrics, fmt):
    """Step `step` of `directory` replaced by one saved elsewhere with `metrics`: a file step by
    an atomic rename over it, a step directory deleted and renamed into its place."""
    elsewhere = os.path.join(os.path.dirname(directory), f"elsewhere-{step}")
    with jckpt.CheckpointManager(elsewhere, options=jckpt.CheckpointOptions(format=fmt),
                                 new_lineage=True) as other:
        other.save(step, at(-step), metrics=metrics)
    source, target = os.path.join(elsewhere, step_name(step)), os.path.join(directory, step_name(step))
    if os.path.isdir(target):
        import shutil
        shutil.rmtree(target)
    else:  # the same size: only the file is new
        assert os.path.getsize(source) == os.path.getsize(target)
    os.replace(source, target)


@pytest.mark.parametrize("fmt", ["jckpt", "safetensors"])
def test_a_step_replaced_in_place_is_read_again_at_reload(tmp_path, fmt, monkeypatch):
    """A step replaced under its own name (a file of the same size) is not the step the
    reader read before: its metadata, arrays and lineage are the new step's."""
    run_dir = str(tmp_path / "run")
    with jckpt.CheckpointManager(run_dir, options=jckpt.CheckpointOptions(format=fmt)) as run:
        for step in (1, 2):
            run.save(step, at(step), metrics={"loss": 0.5})
    with jckpt.CheckpointManager(run_dir, read_only=True) as reader:
        assert reader.metrics(1) == reader.metrics(2) == {"loss": 0.5}
        reads = counting_reads(monkeypatch)
        for step in (1, 2):  # an earlier step, and the latest
            replaced(run_dir, step, {"loss": 0.7}, fmt)
            assert reader.reload() == [1, 2] and reads == [step_name(step)]
            assert reader.metrics(step) == {"loss": 0.7}
            got = reader.restore(step, target=at(0))
            np.testing.assert_array_equal(got.tree["w"], at(-step)["w"])
            del reads[:]  # a restore reads the step's metadata again
        assert reader.lineage != run.lineage  # the latest step's, as read again


@pytest.mark.parametrize("kw", [{"options": jckpt.CheckpointOptions(format="npz")},
                                {"directory_steps": True}], ids=["step-directory", "indexed"])
def test_a_step_retention_is_deleting_is_gone_to_a_reader_not_unfinished(monkeypatch, kw):
    """In a bucket, retention deletes a step prefix's index or record first, then the files
    under it. A reader listing in between found a prefix of pieces without a marker, as a save
    in progress leaves: it called the step unfinished, and a restore of it said "no step, what
    a save or a deletion that did not finish leaves". Below a published step it can be no save
    (a manager saves only above its steps): the step is being deleted, and is gone."""
    from jckpt.services import steps
    url = f"memory://reader-gap-{next(_MEMORY)}/run"
    backend = backend_for(url)
    seen = {}
    real = type(backend).remove_all

    def remove_all(self, paths, *, below=True):
        if below and not seen:  # the markers are deleted, the pieces not yet: a reader lists
            assert backend.list(f"{url}/{step_name(1)}")
            seen["found"] = steps.scan(backend, url)
            with jckpt.CheckpointManager(url, read_only=True) as reader:
                seen["steps"], seen["latest"] = reader.all_steps(), reader.latest_step()
                with pytest.raises(jckpt.FormatError) as e:
                    reader.restore(1)
                seen["error"] = e.value
        return real(self, paths, below=below)
    monkeypatch.setattr(type(backend), "remove_all", remove_all)
    with jckpt.CheckpointManager(url, keep_last=2, asynchronous=False, **kw) as run:
        for step in (1, 2, 3):
            run.save(step, at(step))
    assert seen["steps"] == [2, 3] and seen["latest"] == 3
    assert seen["error"].message == "no step 1: retention deleted it"
    assert "pick one of [2, 3]" in seen["error"].fix
    assert seen["found"].unfinished == () and seen["found"].removing == (step_name(1),)


def test_a_closed_writer_reads_as_of_its_close_and_names_the_reader_for_what_is_there_now(tmp_path):
    """After `close()` a writer's queries and `restore()` still answer, as orbax's manager does,
    from its listing as of its close, and a step another writer removed since is an error
    naming the fix. Its `reload()` said "this manager is their writer", which it no longer is,
    and fixed it with `all_steps()`, the stale listing: it now names the read-only manager."""
    first = jckpt.CheckpointManager(tmp_path, keep_last=1)
    first.save(1, {"w": np.ones(2)})
    first.close()
    assert first.all_steps() == [1] and first.restore().step == 1  # harmless: as of its close
    with pytest.raises(jckpt.CheckpointError, match="the writer is closed"):
        first.save(2, {"w": np.ones(2)})
    with jckpt.CheckpointManager(tmp_path, keep_last=1) as second:
        second.save(2, {"w": np.ones(2)})
    assert first.all_steps() == [1]  # its listing, not what is there now
    with pytest.raises(jckpt.FormatError, match="it was removed since the manager listed") as gone:
        first.restore()
    assert "open the manager again" in gone.value.fix
    with pytest.raises(jckpt.InputError, match="was their writer and is closed") as e:
        first.reload()
    assert "read_only=True" in e.value.fix and "all_steps" not in e.value.fix
    assert jckpt.CheckpointManager(tmp_path, read_only=True).all_steps() == [2]  # what the fix says
