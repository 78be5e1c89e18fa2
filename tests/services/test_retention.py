"""Which steps a manager keeps (jckpt.services.retention): the keep rules and the ranking by a metric."""

import dataclasses
import math
import warnings

import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError
from jckpt.services.retention import Retention, check_metrics, check_step, ranked

NAN = float('nan')


def steps(*numbers, metric='loss', values=None):
    """``{step: {metric: value}}`` (value: ``values[i]``, else the step itself)."""
    values = values or [float(s) for s in numbers]
    return {s: {metric: v} for s, v in zip(numbers, values)}


# --- the policy --------------------------------------------------------------------------------

def test_no_rule_keeps_every_step():
    assert Retention().doomed(steps(1, 2, 3)) == []


def test_no_step_dooms_nothing():
    assert Retention(keep_last=1).doomed({}) == []


def test_keep_last():
    assert Retention(keep_last=2).doomed(steps(5, 1, 4, 2, 3)) == [1, 2, 3]
    assert Retention(keep_last=10).doomed(steps(1, 2, 3)) == []


def test_keep_every_keeps_the_multiples_and_the_latest():
    assert Retention(keep_every=3).doomed(steps(*range(1, 11))) == [1, 2, 4, 5, 7, 8]


def test_the_latest_step_is_always_kept():
    # the latest is the worst by the metric and not a multiple: kept all the same
    metrics = steps(10, 20, 31, values=[0.1, 0.2, 9.0])
    assert Retention(keep_best=1, best_metric='loss').doomed(metrics) == [20]
    assert Retention(keep_every=10).doomed(metrics) == []


def test_rules_combine_as_a_union():
    metrics = steps(*range(1, 13), values=[1.0 / s for s in range(1, 13)])
    metrics[3] = {'loss': 0.001}
    metrics[12] = {'loss': 9.0}
    policy = Retention(keep_last=2, keep_every=5, keep_best=1, best_metric='loss')
    assert policy.doomed(metrics) == [1, 2, 4, 6, 7, 8, 9]


@pytest.mark.parametrize('mode,kept', [('min', [1, 2]), ('max', [4, 5])])
def test_keep_best_by_min_or_max(mode, kept):
    metrics = steps(1, 2, 3, 4, 5, values=[0.1, 0.2, 0.3, 0.5, 0.4])
    policy = Retention(keep_best=2, best_metric='loss', best_mode=mode)
    doomed = policy.doomed(metrics)
    assert sorted(set(metrics) - set(doomed)) == sorted({*kept, 5})


def test_steps_without_the_metric_or_with_nan_are_not_ranked():
    metrics = {1: {'loss': 0.5}, 2: {'acc': 0.9}, 3: {'loss': NAN}, 4: {'loss': 0.7}, 5: {}}
    assert Retention(keep_best=3, best_metric='loss').doomed(metrics) == [2, 3]


def test_doomed_does_not_change_its_input():
    metrics = steps(1, 2, 3)
    before = {s: dict(v) for s, v in metrics.items()}
    Retention(keep_last=1).doomed(metrics)
    assert metrics == before


# --- the ranking -------------------------------------------------------------------------------

def test_ranked_best_first():
    metrics = {1: {'loss': 0.5}, 2: {'loss': 0.1}, 3: {'loss': 0.4}, 4: {'loss': 0.9}}
    assert ranked(metrics, 'loss', 'min') == [2, 3, 1, 4]
    assert ranked(metrics, 'loss', 'max') == [4, 1, 3, 2]


@pytest.mark.parametrize('mode', ['min', 'max'])
def test_ties_go_to_the_later_step(mode):
    metrics = steps(3, 1, 2, values=[0.5, 0.5, 0.5])
    assert ranked(metrics, 'loss', mode) == [3, 2, 1]
    assert Retention(keep_best=1, best_metric='loss', best_mode=mode).doomed(
        {**metrics, 4: {'other': 1.0}}) == [1, 2]


def test_ranked_leaves_out_nan_infinities_and_missing():
    metrics = {1: {'loss': NAN}, 2: {'loss': math.inf}, 3: {'loss': -math.inf}, 4: {'x': 0.0},
               5: {'loss': 0.0}, 6: {'loss': 1.0}}
    assert ranked(metrics, 'loss', 'min') == [5, 6]
    assert ranked(metrics, 'loss', 'max') == [6, 5]
    assert ranked(metrics, 'acc', 'min') == []


@pytest.mark.parametrize('mode,best', [('max', math.inf), ('min', -math.inf)])
def test_an_infinite_metric_is_never_kept_as_best(mode, best):
    """An `acc` of inf (a broken evaluation) was kept as the best step for good."""
    metrics = {1: {'acc': 0.5}, 2: {'acc': best}, 3: {'acc': 0.9 if mode == 'max' else 0.1},
               4: {'acc': 0.7}, 5: {'acc': 0.6}}
    assert Retention(keep_best=1, best_metric='acc', best_mode=mode).doomed(metrics) == [1, 2, 4]


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize('field', ['keep_last', 'keep_every', 'keep_best'])
@pytest.mark.parametrize('value', [0, -1, 1.5, '2'])
def test_counts_must_be_positive_integers(field, value):
    extra = {'best_metric': 'loss'} if field == 'keep_best' else {}
    with pytest.raises(InputError, match=f"{field} must be a positive integer"):
        Retention(**{field: value}, **extra)


def test_a_bool_is_not_a_count():
    with pytest.raises(InputError, match='keep_last must be a positive integer'):
        Retention(keep_last=True)


def test_best_mode_and_best_metric_are_checked():
    with pytest.raises(InputError, match="best_mode must be 'min' or 'max'"):
        Retention(best_mode='median')
    with pytest.raises(InputError, match='keep_best needs best_metric') as info:
        Retention(keep_best=1)
    assert info.value.fix == 'name the metric to rank by'


def test_a_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Retention(keep_last=1).keep_last = 2  # type: ignore[misc]


# --- metrics as the manager receives them ------------------------------------------------------

def test_check_metrics_gives_floats_by_name():
    assert check_metrics(None, 'd') == {}
    out = check_metrics({'loss': 1, 'acc': '0.5', 7: 2.5}, 'd')
    assert out == {'loss': 1.0, 'acc': 0.5, '7': 2.5}
    assert all(type(v) is float for v in out.values())
    assert math.isnan(check_metrics({'loss': NAN}, 'd')['loss'])


@pytest.mark.parametrize('value', ['low', None, [1.0], {'a': 1}])
def test_check_metrics_refuses_what_is_not_a_number(value):
    with pytest.raises(InputError, match="metric 'loss' is not a number") as info:
        check_metrics({'loss': value}, 'run/step_1')
    assert info.value.file == 'run/step_1' and 'float(loss)' in info.value.fix


def test_a_metric_name_no_text_holds_is_refused_at_save(tmp_path):
    """`metrics={'l\ud800': 1.0, 'loss': 2.0}` was saved, and the step read back with no
    metrics at all: its JSON record was taken as damaged."""
    with pytest.raises(InputError, match="lone surrogate") as info:
        check_metrics({'l\ud800': 1.0, 'loss': 2.0}, 'run/step_1')
    assert info.value.file == 'run/step_1'
    with jckpt.CheckpointManager(tmp_path, asynchronous=False) as mgr:
        with pytest.raises(InputError, match="lone surrogate"):
            mgr.save(1, {'w': np.ones(2)}, metrics={'l\ud800': 1.0, 'loss': 2.0})
        mgr.save(1, {'w': np.ones(2)}, metrics={'lösş': 1.0, 'loss': 2.0})
    assert jckpt.CheckpointManager(tmp_path, read_only=True).metrics(1) == {'lösş': 1.0, 'loss': 2.0}


def test_check_step_takes_non_negative_integers_only():
    import jax.numpy as jnp
    assert check_step(0, "run") == 0 and check_step(7, "run") == 7
    for ok in (np.int64(60), np.uint8(3), jnp.int32(5)):  # a loop counter from numpy or JAX
        assert check_step(ok, "run") == int(ok) and type(check_step(ok, "run")) is int
    for bad in (-1, "1", 1.0, True, None, np.bool_(True), np.int64(-2), np.float32(1), jnp.ones(2)):
        with pytest.raises(InputError, match="step must be a non-negative integer"):
            check_step(bad, "run")


def test_a_tree_given_as_the_step_is_not_printed_whole():
    tree = {f"layer_{i}": np.zeros(1000) for i in range(50)}
    with pytest.raises(InputError) as e:
        check_step(tree, "run")
    assert len(str(e.value)) < 300 and "dict" in e.value.message
    assert "save(step, tree)" in e.value.fix


def test_check_metrics_refuses_what_is_not_a_mapping():
    with pytest.raises(InputError, match="metrics must be a mapping"):
        check_metrics("loss", "run")
    assert check_metrics(None, "run") == {}


def test_metrics_without_the_metric_keep_best_ranks_by_warn(tmp_path):
    """A misspelt best_metric let retention delete the best step without a word."""
    import jax.numpy as jnp
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"step 1's metrics \['val_los'\] have no 'val_loss'.*misspelt"):
        with jckpt.CheckpointManager(run, keep_last=1, keep_best=1, best_metric="val_loss") as mgr:
            mgr.save(1, {"w": jnp.ones(2)}, metrics={"val_los": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_metrics({"val_loss": 1.0, "lr": 0.1}, "run", "val_loss")
        check_metrics({}, "run", None)  # no keep_best: no step is ranked, nothing to say
        check_metrics({"lr": 0.1}, "run", None)


def test_a_step_saved_without_metrics_under_keep_best_warns_once_at_its_save(tmp_path):
    """Such a step was deleted by retention later without a word."""
    import jax.numpy as jnp
    with jckpt.CheckpointManager(tmp_path / "run", keep_last=1, keep_best=1, best_metric="loss",
                                 asynchronous=False) as mgr:
        with pytest.warns(UserWarning) as told:
            mgr.save(1, {"w": jnp.ones(2)}, metrics={"loss": 0.5})
            mgr.save(2, {"w": jnp.ones(2)})
            mgr.save(3, {"w": jnp.ones(2)}, metrics={"loss": 0.7})
        assert mgr.all_steps() == [1, 3]  # step 2 went: neither the last nor a best one
    assert len(told) == 1
    message = str(told[0].message)
    assert "step 2 was saved with no metrics" in message and "'loss'" in message
    assert "keep_last, keep_every or being the latest" in message


@pytest.mark.parametrize('mode,value', [('max', math.inf), ('min', -math.inf), ('min', NAN)])
def test_a_non_finite_ranked_metric_warns_once_naming_the_step(tmp_path, mode, value):
    import jax.numpy as jnp
    with jckpt.CheckpointManager(tmp_path / "run", keep_last=1, keep_best=1, best_metric="acc",
                                 best_mode=mode, asynchronous=False) as mgr:
        with pytest.warns(UserWarning) as told:
            mgr.save(1, {"w": jnp.ones(2)}, metrics={"acc": 0.5})
            mgr.save(2, {"w": jnp.ones(2)}, metrics={"acc": value})
            mgr.save(3, {"w": jnp.ones(2)}, metrics={"acc": 0.4 if mode == 'max' else 0.6})
        assert mgr.all_steps() == [1, 3] and mgr.best_step() == 1
    assert len(told) == 1
    assert f"step 2's 'acc' is {value}, which is never ranked as a best one" in str(told[0].message)
