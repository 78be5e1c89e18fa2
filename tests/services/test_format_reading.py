"""Reading a step directory of the manager's format layer: the reader its magic picks, partial
loads, namespaces, restore's own rules, and the errors a damaged step gives."""

import errno
import json
import os

import numpy as np
import pytest

import jckpt
from jckpt.errors import (
    CheckpointError,
    FormatError,
    MismatchError,
    MissingEntryError,
    StorageError,
)
from jckpt.services.format_reading import metadata_of
from jckpt.services.formats import CheckpointLoadOptions, CheckpointOptions
from tests.services.test_formats import assert_trees_equal, gpt2, optimizer, saved_steps


def test_the_magic_picks_the_reader_not_the_name(tmp_path):
    def as_jckpt(tree, path):  # a jckpt file named model.bin
        jckpt.save(jckpt.Context(), tree, path)

    def never(path):
        raise AssertionError("a jckpt model file is read as jckpt")

    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='llmc', model_writer=as_jckpt),
                                 load_options=CheckpointLoadOptions(model_loader=never)) as mgr:
        mgr.save(1, items={'model': {'w': np.arange(3.0)}, 'opt': optimizer(1)})
        mgr.wait_durable()
        assert jckpt.detect_format(tmp_path / 'step_00000001.jckpt' / 'model.bin') == 'jckpt'
        np.testing.assert_array_equal(mgr.restore().tree['model']['w'], np.arange(3.0))


def test_partial_loads_read_the_model_only(tmp_path):
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='llmc')) as mgr:
        mgr.save(1, items={'model': gpt2(1), 'opt': optimizer(1)})
        mgr.wait_durable()
        model_only = CheckpointLoadOptions(load_optimizer_state=False)
        assert list(mgr.restore(options=model_only).tree) == ['model']
        assert_trees_equal(mgr.restore(namespaces=['model']).tree['model'], gpt2(1))
        r = mgr.restore(target={'model': gpt2(0)}, namespaces=['model'])
        assert_trees_equal(r.tree['model'], gpt2(1))
        assert_trees_equal(mgr.restore(target={'opt': optimizer(0)}, namespaces=['opt']).tree['opt'],
                           optimizer(1))
        with pytest.raises(MissingEntryError, match="not loaded"):
            mgr.restore(target={'opt': optimizer(0)}, namespaces=['opt'], options=model_only)


@pytest.mark.parametrize('member', ['model.npz', 'optimizer.jckpt', 'trainer_state.json'])
def test_a_step_member_that_is_a_link_is_refused(tmp_path, member):
    """A link to a file outside the step was followed: restore returned its arrays, and verify
    said OK."""
    run = tmp_path / 'run'
    with saved_steps(run):
        pass
    d = run / 'step_00000002.jckpt'
    outside = tmp_path / member
    os.replace(d / member, outside)
    os.symlink(outside, d / member)
    with jckpt.CheckpointManager(run, options=CheckpointOptions(format='npz')) as mgr:
        with pytest.raises(FormatError, match="is a symbolic link") as e:
            mgr.restore(step=2)
        assert e.value.file == str(d / member) and e.value.fix
    report = jckpt.verify(run)
    assert not report.ok and 'is a symbolic link' in report.render()


def test_namespaces_may_be_one_name_as_restore_takes_it(tmp_path):
    """`namespaces='model'` asked a foreign-format step for namespaces 'm', 'o', 'd', ..."""
    with saved_steps(tmp_path) as mgr:
        one = mgr.restore(namespaces='model').tree
        assert list(one) == ['model'] and one['model']['w'].tolist() == [2.0, 2.0]
        both = mgr.restore(namespaces=('model', 'opt')).tree
        assert sorted(both) == ['model', 'opt']


def test_a_namespace_the_step_lacks_is_named_with_those_it_holds(tmp_path):
    """A target for the manager's default namespace was told only that optimizer.jckpt has no
    namespace 'jckpt' (fix: "the file holds ['opt']"): nothing said where the model was."""
    with saved_steps(tmp_path) as mgr:
        with pytest.raises(MissingEntryError, match=r"step 2 has no namespace 'jckpt': it holds "
                                                     r"'model' \(the model, model.npz\)") as e:
            mgr.restore(target={'w': np.zeros(2)})
        assert "Context(namespace='model')" in e.value.fix
        assert mgr.restore(target={'w': np.zeros(2)},
                           ctx=jckpt.Context(namespace='model')).tree['w'].tolist() == [2, 2]


def test_a_foreign_format_step_warns_of_unsharded_specs_as_restore_does(tmp_path, monkeypatch):
    """The warning that specs without a sharding all go to one accelerator came from restore
    of a jckpt step only."""
    import jax

    from jckpt.trees import placement
    seen = []
    monkeypatch.setattr(placement, 'warn_unsharded_specs', lambda specs, path: seen.append(specs))
    with saved_steps(tmp_path) as mgr:
        target = {'w': jax.ShapeDtypeStruct((2,), np.float64)}
        mgr.restore(target=target, ctx=jckpt.Context(namespace='model'))
    assert seen == [['model/w']]


def test_a_damaged_step_directory_names_the_step_and_the_file(tmp_path):
    with saved_steps(tmp_path) as mgr:
        d = tmp_path / 'step_00000002.jckpt'
        os.remove(d / 'model.npz')
        with pytest.raises(FormatError, match="step 2 has no model file model.npz") as e:
            mgr.restore()
        assert e.value.file == str(d / 'model.npz')
        jckpt.adapters.write({'jckpt': {'w': np.ones(2)}}, d / 'model.npz', format='safetensors')
        with pytest.raises(FormatError, match="step 2: the model file is safetensors, not npz"):
            mgr.restore()
        (d / 'trainer_state.json').write_text('{"model": ')
        with pytest.raises(FormatError, match="step 2: trainer_state.json is not valid JSON"):
            mgr.restore(2)
        (d / 'trainer_state.json').write_text('{"model": "../x"}')
        with pytest.raises(FormatError, match="not a step record"):
            mgr.restore(2)
        assert mgr.restore(1).tree['model']['w'][0] == 1  # the previous step is untouched


def test_a_loader_that_raises_or_returns_another_tree(tmp_path):
    def raising(path):
        raise ValueError("bad bytes")

    with saved_steps(tmp_path, fmt='safetensors') as mgr:
        with pytest.raises(CheckpointError, match="step 2: reading the model with its loader: bad bytes"):
            mgr.restore(options=CheckpointLoadOptions(model_loader=raising))
        wrong = CheckpointLoadOptions(model_loader=lambda path: {'v': np.ones(2)})
        with pytest.raises(MissingEntryError, match="step 2: the model has no leaf"):
            mgr.restore(target={'w': np.zeros(2)}, ctx=jckpt.Context(namespace='model'),
                        options=wrong)


def test_a_loader_that_cannot_open_its_file_is_a_storage_error_naming_the_step(tmp_path):
    """A loader's OSError (a loader given a URL it cannot open, say) said "the model loader
    failed failed: ..." and named no step."""
    def missing(path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    with saved_steps(tmp_path, fmt='safetensors') as mgr:
        with pytest.raises(StorageError, match="step 2: reading the model with its loader failed: "
                                               "No such file") as e:
            mgr.restore(options=CheckpointLoadOptions(model_loader=missing))
    assert e.value.errno == errno.ENOENT and e.value.file.endswith("model.safetensors")


@pytest.mark.parametrize('fmt', ['npz', 'safetensors', 'torch'])
def test_a_foreign_step_restores_by_restores_own_rules(tmp_path, fmt):
    """Typed PRNG keys (an NNX state with Rngs) come back as keys, and a weakly typed target
    (a Linen TrainState's `step=0` under jax.eval_shape) takes the stored 64-bit integer,
    as they do from a jckpt step."""
    import jax
    import jax.numpy as jnp
    tree = {'k': jax.random.key(3), 'step': 7, 'w': jnp.arange(3.0)}
    target = jax.eval_shape(lambda: {'k': jax.random.key(0), 'step': 0, 'w': jnp.zeros(3)})
    assert target['step'].weak_type
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format=fmt)) as mgr:
        mgr.save(1, tree)
        mgr.wait_durable()
        got = mgr.restore(target=target).tree
        assert jax.random.key_impl(got['k']) == jax.random.key_impl(tree['k'])
        assert (jax.random.key_data(got['k']) == jax.random.key_data(tree['k'])).all()
        assert int(got['step']) == 7 and (got['w'] == tree['w']).all()
        with pytest.raises(MismatchError, match=r"step 1: the file holds plain uint32\[2\] data"):
            mgr.restore(target={**target, 'k': jax.random.key(0, impl='rbg')})
        with pytest.raises(MismatchError, match="step 1: dtype mismatch"):
            mgr.restore(target={**target, 'w': jnp.zeros(3, jnp.int32)})


@pytest.mark.parametrize('fmt', ['npz', 'safetensors', 'torch'])
def test_a_foreign_step_restores_onto_a_targets_abstract_mesh(tmp_path, fmt):
    """`jax.eval_shape` of a sharded state (or `nnx.eval_shape` under `jax.set_mesh`) gives
    specs on an abstract mesh: a jckpt step restored onto its concrete mesh, a step in another
    format raised JAX's bare ValueError ("device_set is not implemented")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.helpers import cpu_mesh
    mesh = cpu_mesh((2, 4), ('data', 'model'))
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P('data', 'model')))
    target = {'w': jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                        sharding=NamedSharding(mesh.abstract_mesh, P('model')))}
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format=fmt)) as mgr:
        mgr.save(1, {'w': w})
        mgr.wait_durable()
        got = mgr.restore(target=target).tree['w']
    assert got.sharding.mesh == mesh and got.sharding.spec == P('model')
    assert (np.asarray(got) == np.asarray(w)).all()


@pytest.mark.parametrize('fmt', ['npz', 'safetensors', 'torch'])
def test_a_foreign_step_without_a_target_is_placed_as_a_jckpt_step_is(tmp_path, fmt):
    """Its arrays came back as host numpy arrays where a jckpt step's are jax.Arrays."""
    import jax
    import jax.numpy as jnp
    with jckpt.CheckpointManager(tmp_path / fmt, options=CheckpointOptions(format=fmt)) as mgr:
        mgr.save(1, {'w': jnp.arange(3.0), 'b': jnp.ones(2, jnp.bfloat16)}, force=True)
        mgr.wait_durable()
        model = mgr.restore().tree['jckpt']
        assert all(isinstance(v, jax.Array) for v in model.values()), model
        assert model['b'].dtype == jnp.bfloat16 and model['w'].tolist() == [0, 1, 2]
    host = jckpt.Context(host=True)
    with jckpt.CheckpointManager(tmp_path / fmt, ctx=host,
                                 options=CheckpointOptions(format=fmt)) as mgr:
        assert type(mgr.restore().tree['jckpt']['w']) is np.ndarray  # as `load` with host=True


def test_a_records_metadata_is_what_a_step_files_header_holds(tmp_path):
    """The record's fields come back under the header's keys, so a step directory lists, sorts by
    metric and resumes as a step file does."""
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='npz')) as mgr:
        mgr.save(3, {'w': np.ones(2)}, metrics={'loss': 0.5}, force=True)
        mgr.wait_durable()
    record = json.loads((tmp_path / 'step_00000003.jckpt' / 'trainer_state.json').read_text())
    meta = metadata_of(record)
    assert json.loads(meta['jckpt.metrics']) == {'loss': 0.5} and meta['jckpt.step'] == '3'


def test_an_npy_step_restores_into_the_target_it_was_saved_from(tmp_path):
    """An .npy file keeps no path: a model of one leaf under a key, `{'w': x}`, came back as a
    bare array, and its own structure as the target was a MissingEntryError."""
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='npy')) as mgr:
        mgr.save(1, {'w': np.arange(3.0, dtype=np.float32)})
        mgr.wait_durable()
        got = mgr.restore(target={'w': np.zeros(3, np.float32)}).tree
        assert list(got) == ['w'] and got['w'].tolist() == [0, 1, 2]
        with pytest.raises(MismatchError, match="step 1: shape mismatch"):
            mgr.restore(target={'w': np.zeros(4, np.float32)})
