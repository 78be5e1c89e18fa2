"""The summary of a manager's directory (jckpt.tools.manager_info): steps, latest, best, damage."""

import json
import os
import sys
import threading

import numpy as np
import pytest

import jckpt
from jckpt.format.names import step_name
from jckpt.storage import backend_for
from jckpt.tools.manager_info import ManagerInfo, StepInfo, manager_info, step_info
from jckpt.tools.render import human_bytes
from tests.helpers import write_arrays, write_directory

manager_info_mod = sys.modules[ManagerInfo.__module__]


def _step(directory, step, metrics, **meta):
    return write_arrays(os.path.join(directory, step_name(step)), {'w': np.zeros(2, np.float32)},
                        metadata={'jckpt.step': str(step), 'jckpt.metrics': json.dumps(metrics),
                                  'jckpt.lineage': 'run1', 'jckpt.generation': str(step), **meta})


def test_manager_directory(tmp_path):
    for step, m in ((1, {'loss': 3.0, 'acc': 0.1}), (2, {'loss': 1.0, 'acc': 0.5}),
                    (3, {'loss': 1.0, 'acc': 0.4}), (4, {'acc': 0.9})):
        _step(tmp_path, step, m)
    s = manager_info(tmp_path)
    assert isinstance(s, ManagerInfo) and s.kind == 'manager'
    assert [x.step for x in s.steps] == [1, 2, 3, 4]
    assert s.latest == 4 and s.best_metric == 'loss'
    assert s.best == 3  # ties go to the later step, as the manager ranks them
    assert manager_info(tmp_path, best_metric='acc', best_mode='max').best == 4
    assert s.metric_names == ['acc', 'loss']
    text = repr(s)
    assert 'lineage: run1' in text and 'best 3 by loss (min)' in text
    assert '<table>' in s._repr_html_()
    json.dumps(s.to_dict())
    with pytest.raises(jckpt.InputError):
        manager_info(tmp_path, best_mode='median')


def test_an_infinite_or_nan_metric_is_never_best_as_in_the_manager(tmp_path):
    """`jckpt.info` named a step with acc=inf best, where the manager's best_step did not."""
    for step, acc in ((1, 0.5), (2, float('inf')), (3, float('nan')), (4, 0.2)):
        _step(tmp_path, step, {'acc': acc})
    assert manager_info(tmp_path, best_metric='acc', best_mode='max').best == 1


def test_a_real_manager_directory(tmp_path):
    with jckpt.CheckpointManager(tmp_path, asynchronous=False) as mgr:
        for step, loss in ((10, 0.5), (20, 0.2)):
            mgr.save(step, {'w': np.full(3, step, np.float32)}, metrics={'loss': loss},
                     trainer_state=jckpt.TrainerState(global_step=step))
    s = manager_info(tmp_path)
    assert s.latest == 20 and s.best == 20
    assert [x.generation for x in s.steps] == [1, 2]
    assert s.steps[0].lineage == s.steps[1].lineage is not None
    step = jckpt.info(s.steps[1].path)
    assert step.to_dict()['trainer_state']['global_step'] == 20
    assert step.to_dict()['metrics'] == {'loss': 0.2}


def test_step_info_of_a_file(tmp_path):
    path = _step(tmp_path, 5, {'loss': 2, 'acc': 0.5})
    s = step_info(5, path)
    assert isinstance(s, StepInfo)
    assert (s.step, s.path, s.kind, s.size) == (5, path, 'file', os.path.getsize(path))
    assert (s.entries, s.payload_bytes, s.generation, s.lineage, s.error) == (1, 8, 5, 'run1', None)
    assert s.metrics == {'loss': 2.0, 'acc': 0.5} and type(s.metrics['loss']) is float
    assert s.to_dict()['metrics'] == {'loss': 2.0, 'acc': 0.5}


def test_step_info_of_a_directory_step(tmp_path):
    path = write_directory(tmp_path / step_name(7), {'w': np.arange(6.0)},
                           metadata={'jckpt.metrics': '{"loss": 0.25}', 'jckpt.generation': '2'})
    s = step_info(7, path)
    assert (s.kind, s.entries, s.payload_bytes, s.generation) == ('directory', 1, 48, 2)
    assert s.metrics == {'loss': 0.25} and s.error is None
    assert 'multi-process' in repr(manager_info(tmp_path))


def test_a_damaged_step_is_listed_with_the_reason(tmp_path):
    _step(tmp_path, 1, {'loss': 0.1})
    _step(tmp_path, 2, {'loss': 0.5})
    bad = tmp_path / step_name(3)
    bad.write_bytes(b'\x00\x00\x00\x05((((')
    (tmp_path / step_name(4)).mkdir()  # a directory step without its index
    s = manager_info(tmp_path)
    by_step = {x.step: x for x in s.steps}
    assert by_step[3].error is not None and by_step[3].entries is None
    assert by_step[3].size == 8 and by_step[3].kind == 'file' and by_step[3].metrics == {}
    assert by_step[4].error is not None and by_step[4].kind == 'directory'
    assert s.latest == 2 and s.best == 1  # only readable steps count
    text = repr(s)
    assert text.count('unreadable: ') == 2
    assert json.loads(json.dumps(s.to_dict()))['steps'][2]['error'] == by_step[3].error


def test_metrics_and_generation_that_cannot_be_read_are_left_out(tmp_path):
    _step(tmp_path, 1, {}, **{'jckpt.generation': 'many'})
    write_arrays(tmp_path / step_name(2), {'w': np.zeros(1)},
                 metadata={'jckpt.metrics': '[1, 2]'})
    s = manager_info(tmp_path)
    assert [(x.metrics, x.generation, x.lineage) for x in s.steps] == [
        ({}, None, 'run1'), ({}, None, None)]
    assert s.best_metric is None and s.best is None and s.latest == 2


def test_best_ignores_nan_and_steps_without_the_metric(tmp_path):
    _step(tmp_path, 1, {'loss': 0.9})
    write_arrays(tmp_path / step_name(2), {'w': np.zeros(1)},
                 metadata={'jckpt.metrics': '{"loss": NaN}'})
    _step(tmp_path, 3, {'acc': 0.2})
    s = manager_info(tmp_path)
    assert s.best == 1 and s.latest == 3
    assert manager_info(tmp_path, best_mode='max').best == 1
    assert manager_info(tmp_path, best_metric='missing').best is None


def test_a_best_metric_no_step_records_is_said_not_left_blank(tmp_path):
    """`jckpt inspect run --best-metric acuracy` (misspelt) showed no best step and no word."""
    _step(tmp_path, 1, {'loss': 0.9, 'acc': 0.5})
    _step(tmp_path, 2, {'loss': float('nan')})
    first = manager_info(tmp_path, best_metric='acuracy').render().splitlines()[0]
    assert first.endswith("latest 2, no best by acuracy (no step records it; they record acc, loss)")
    assert 'best 1 by loss' in manager_info(tmp_path).render().splitlines()[0]
    write_arrays(tmp_path / step_name(1), {'w': np.zeros(1)},
                 metadata={'jckpt.metrics': '{"loss": NaN}'})
    assert "no best by loss (no finite value)" in manager_info(tmp_path).render()
    with pytest.raises(jckpt.InputError, match="best_mode must be") as e:
        manager_info(tmp_path, best_mode='lowest')
    assert e.value.file == str(tmp_path) and "'min'" in e.value.fix


def test_the_default_best_metric(tmp_path):
    _step(tmp_path, 1, {'b_acc': 0.5, 'a_err': 0.1})
    _step(tmp_path, 2, {'b_acc': 0.7, 'a_err': 0.3})
    s = manager_info(tmp_path)
    assert s.best_metric == 'a_err' and s.best == 1  # no loss: the first name in sorted order
    assert manager_info(tmp_path, best_metric='b_acc', best_mode='max').best == 2


def test_a_lineage_id_with_a_newline_cannot_forge_a_row(tmp_path):
    write_arrays(tmp_path / step_name(1), {'w': np.ones(2)},
                 metadata={'jckpt.lineage': 'abc\n 999  1 TiB'})
    text = manager_info(str(tmp_path)).render()
    assert 'lineage: abc\\n 999  1 TiB' in text.splitlines()


def test_only_step_names_are_steps(tmp_path):
    _step(tmp_path, 12, {'loss': 1.0})
    write_arrays(tmp_path / 'other.jckpt', {'w': np.zeros(1)})
    (tmp_path / 'step_12.jckpt').write_bytes(b'x')  # fewer than eight digits
    (tmp_path / (step_name(13) + '.jckpt-lease')).write_bytes(b'')
    s = manager_info(tmp_path)
    assert [x.step for x in s.steps] == [12]
    assert s.size == os.path.getsize(tmp_path / step_name(12))


def test_an_empty_directory_has_no_steps(tmp_path):
    s = manager_info(tmp_path)
    assert s.steps == () and s.latest is None and s.best is None and s.size == 0
    assert '(no steps)' in repr(s)


def test_render_shows_the_last_steps(tmp_path):
    for step in range(1, 46):
        _step(tmp_path, step, {'loss': 1.0 / step})
    s = manager_info(tmp_path)
    assert '... 5 earlier steps' in repr(s)
    assert '... 2 earlier steps' in s.render(limit=43)
    assert '... ' not in s.render()
    last = repr(s).split('\n')[-1]
    assert last.split()[0] == '45' and last.endswith('latest, best')


def test_several_lineages_are_named(tmp_path):
    _step(tmp_path, 1, {}, **{'jckpt.lineage': 'b'})
    _step(tmp_path, 2, {}, **{'jckpt.lineage': 'a'})
    assert 'lineages: a, b' in repr(manager_info(tmp_path))


def test_step_directories_with_a_foreign_model_are_summarised_from_their_record(tmp_path):
    with jckpt.CheckpointManager(tmp_path, asynchronous=False,
                                 options=jckpt.CheckpointOptions(format='npz')) as mgr:
        mgr.save(10, items={'model': {'w': np.ones(2, np.float32)}, 'opt': {'m': np.ones(2)}},
                 metrics={'loss': 0.5})
        mgr.save(20, {'w': np.ones(2, np.float32)}, metrics={'loss': 0.7},
                 options=jckpt.CheckpointOptions())
    s = manager_info(tmp_path)
    first = s.steps[0]
    assert (first.kind, first.model, first.metrics, first.generation) == ('model', 'model.npz',
                                                                          {'loss': 0.5}, 1)
    assert first.lineage == s.steps[1].lineage is not None and first.error is None
    assert s.best == 10 and 'model: model.npz' in repr(s)
    # the model file's arrays and the optimizer file's, as `jckpt inspect` reads each
    assert (first.entries, first.payload_bytes) == (2, 2 * 4 + 2 * 8)
    row = repr(s).splitlines()[4]
    assert row.split()[:4] == ['10', *human_bytes(first.size).split(), '2']
    (tmp_path / step_name(10) / 'trainer_state.json').write_text('{')
    damaged = step_info(10, str(tmp_path / step_name(10)))
    assert damaged.kind == 'model' and damaged.error.startswith('step 10: trainer_state.json is not valid')


def test_a_model_no_registered_reader_reads_counts_no_entries(tmp_path):
    def write_raw(tree, path):
        tree['w'].tofile(path)
    opts = jckpt.CheckpointOptions(format='raw', model_writer=write_raw)
    with jckpt.CheckpointManager(tmp_path, asynchronous=False, options=opts) as mgr:
        mgr.save(1, {'w': np.arange(4, dtype=np.float32)})
    step = manager_info(tmp_path).steps[0]
    assert (step.model, step.entries, step.error) == ('model.raw', None, None)
    assert repr(manager_info(tmp_path)).splitlines()[-1].split()[3] == '?'


def test_foreign_format_and_damaged_steps_in_a_bucket_have_their_size():
    """Their size was counted from the local disk: 0 B in a bucket."""
    url = "memory://manager-info/foreign"
    opts = jckpt.CheckpointOptions(format="npz")
    with jckpt.CheckpointManager(url, options=opts) as mgr:
        mgr.save(1, items={"model": {"w": np.ones(256)}, "opt": {"m": np.ones(4)}})
    with jckpt.CheckpointManager(url + "/plain") as mgr:
        mgr.save(2, {"w": np.ones(256)})
    backend = backend_for(url)
    step = backend.list(url)[-1]
    info = manager_info(url).steps[0]
    assert info.kind == "model" and info.size == backend.size(f"{url}/{step}") > 2048
    damaged = f"{url}/plain/{step_name(2)}"
    with backend.create(damaged) as staging:
        os.write(staging.fd, b"\0" * 100)
        staging.publish()
    assert manager_info(url + "/plain").steps[0].size == 100


def test_directory_steps_in_a_bucket_are_read_as_local_ones_are():
    """Step prefixes in a bucket were taken for files: "unreadable: no such checkpoint object"."""
    url = "memory://manager-info/run"
    with jckpt.CheckpointManager(url, directory_steps=True) as mgr:
        mgr.save(4, {"w": np.ones(4)})
        mgr.save(6, {"w": np.ones(4)})
    info = manager_info(url)
    assert [(s.step, s.kind, s.entries, s.error) for s in info.steps] == [
        (4, "directory", 1, None), (6, "directory", 1, None)]


def test_inspecting_a_manager_in_a_bucket_reads_each_file_step_once(s3, s3_server):
    """Each file step cost a HEAD of a step record and a LIST of the step as a prefix before
    its header's GET: `jckpt.info` of 3 steps took 10 requests, now 4."""
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.ones(4, np.float32)}, metrics={"loss": 1 / step})
    before = len(s3_server.requests(s3))
    info = manager_info(url)
    asked = s3_server.requests(s3)[before:]
    assert [s.metrics["loss"] for s in info.steps] == [1, 0.5, 1 / 3]
    assert [s.kind for s in info.steps] == ["file"] * 3
    assert asked[0] == "GET ?delimiter=/&list-type=2&prefix=run/", asked
    assert sorted(asked[1:]) == [f"GET /run/{step_name(s)}" for s in (1, 2, 3)], asked  # together


def test_jckpt_info_of_a_bucket_prefix_lists_it_once_and_reads_each_step_record_once(s3, s3_server):
    """`jckpt.info` (and `jckpt inspect`) of a manager's prefix listed it twice (once to tell
    what it is, once for its steps), and a step in another format cost a HEAD of its record
    before the record's GET: 6 requests for one such step, now 4; 6 for 3 file steps, now 5."""
    url = f"{s3}/run"
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)}, metrics={"loss": 1.0})
        mgr.save(2, items={"model": {"w": np.ones(4, np.float32)}}, metrics={"loss": 0.5},
                 options=jckpt.CheckpointOptions(format="npz"))
    before = len(s3_server.requests(s3))
    info = jckpt.info(url)
    asked = s3_server.requests(s3)[before:]
    assert [(s.kind, s.metrics, s.error) for s in info.steps] == [
        ("file", {"loss": 1.0}, None), ("model", {"loss": 0.5}, None)]
    step = "run/step_00000002.jckpt"
    record, listing = f"GET /{step}/trainer_state.json", f"GET ?list-type=2&prefix={step}/"
    assert sorted(asked[:2]) == ["GET /run", "GET ?delimiter=/&list-type=2&prefix=run/"], asked  # at once
    # the steps are read together: their requests interleave, each step's in its own order
    assert sorted(asked[2:]) == sorted(["GET /run/step_00000001.jckpt", record, listing]), asked
    assert asked.index(record) < asked.index(listing), asked


def test_a_damaged_record_in_a_bucket_is_shown_as_the_steps_error():
    url = "memory://manager-info-damaged/run"
    with jckpt.CheckpointManager(url, options=jckpt.CheckpointOptions(format="npz")) as mgr:
        mgr.save(1, items={"model": {"w": np.ones(4)}})
    backend = backend_for(url)
    with backend.create(f"{url}/step_00000001.jckpt/trainer_state.json") as staging:
        os.write(staging.fd, b"{not json")
        staging.publish()
    [step] = manager_info(url).steps
    assert step.kind == "model" and "not valid JSON" in step.error


def test_the_steps_of_a_bucket_are_read_concurrently(monkeypatch):
    # one GET per step: read in turn, a prefix of a thousand steps took a thousand round trips
    barrier, alone = threading.Barrier(2, timeout=10), []
    read = manager_info_mod.step_info

    def step_info(step, path, **kwargs):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            alone.append(step)
            barrier.reset()
        return read(step, path, **kwargs)

    url = "memory://manager-info-together/run"
    with jckpt.CheckpointManager(url) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.ones(2, np.float32)}, force=True)
    monkeypatch.setattr(manager_info_mod, "step_info", step_info)
    got = manager_info_mod.manager_info(url)
    assert [s.step for s in got.steps] == [1, 2] and got.latest == 2
    assert alone == []
