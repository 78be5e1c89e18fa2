"""The manager's format layer: steps whose model is in llm.c, safetensors, PyTorch or numpy format."""

import dataclasses
import json
import os
import time

import numpy as np
import pytest

import jckpt
from jckpt.adapters import llmc
from jckpt.errors import CheckpointError, InputError, MismatchError, MissingEntryError
from jckpt.services.formats import CheckpointLoadOptions, CheckpointOptions

TINY = llmc.Config(max_seq_len=8, vocab_size=10, num_layers=2, num_heads=2, channels=4,
                   padded_vocab_size=16)


def gpt2(seed, config=TINY):
    """A GPT-2-shaped parameter tree (the form jckpt.adapters.llmc reads and writes)."""
    rng = np.random.default_rng(seed)
    tree = {'h': [{} for _ in range(config.num_layers)],
            'config': {f.name: np.int32(getattr(config, f.name)) for f in dataclasses.fields(config)}}
    for (_, shape), (_, where, per_layer) in zip(llmc.param_shapes(config), llmc.KINDS):
        for node in (tree['h'] if per_layer else [tree]):
            for key in where[:-1]:
                node = node.setdefault(key, {})
            node[where[-1]] = rng.standard_normal(shape).astype(np.float32)
    return tree


def optimizer(seed):
    return {'mu': np.full(5, seed, np.float32), 'count': np.int32(seed)}


def assert_trees_equal(a, b):
    import jax
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


# --- options ---------------------------------------------------------------------------------

def test_options_are_validated_frozen_and_exported():
    assert jckpt.CheckpointOptions is CheckpointOptions
    assert jckpt.CheckpointLoadOptions is CheckpointLoadOptions
    assert CheckpointOptions().format == 'jckpt' and not CheckpointOptions().foreign
    assert CheckpointOptions(format='llmc').model_file == 'model.bin'
    assert CheckpointOptions(format='safetensors').model_file == 'model.safetensors'
    assert CheckpointOptions(format='pth').format == 'torch'
    assert CheckpointOptions(format='torch').model_file == 'model.pth'
    assert CheckpointOptions(format='npz').model_file == 'model.npz'
    with pytest.raises(dataclasses.FrozenInstanceError):
        CheckpointOptions().format = 'llmc'
    for bad in (dict(format='nope'), dict(format=''), dict(format=3),
                dict(format='llmc', model_writer=3), dict(model_writer=lambda t, p: None),
                dict(save_optimizer_state='yes'), dict(format='npz', model_namespace='a b/')):
        with pytest.raises(InputError):
            CheckpointOptions(**bad)
    custom = CheckpointOptions(format='mine', model_writer=lambda t, p: None)
    assert custom.model_file == 'model.mine'
    for bad in (dict(model_loader='x'), dict(load_optimizer_state=1)):
        with pytest.raises(InputError):
            CheckpointLoadOptions(**bad)
    with pytest.raises(InputError, match="options must be a CheckpointOptions"):
        jckpt.CheckpointManager('/tmp/unused-never-created', options={'format': 'llmc'})


# --- each format's step layout -----------------------------------------------------------------

def test_llmc_step_is_a_directory_whose_model_bin_is_what_convert_writes(tmp_path):
    opts = CheckpointOptions(format='llmc')
    with jckpt.CheckpointManager(tmp_path / 'run', options=opts, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, items={'model': gpt2(step), 'opt': optimizer(step)},
                     metrics={'loss': 1.0 / step},
                     trainer_state=jckpt.TrainerState(global_step=step, consumed_batches=4 * step))
        assert mgr.wait_durable(timeout=60)
        assert mgr.all_steps() == [2, 3]
        counters = mgr.counters
        assert counters.durable == 3 and counters.error == 0
        r = mgr.restore()
    d = tmp_path / 'run' / 'step_00000003.jckpt'
    assert sorted(os.listdir(d)) == ['model.bin', 'optimizer.jckpt', 'trainer_state.json']
    assert not (tmp_path / 'run' / 'step_00000001.jckpt').exists()
    assert jckpt.detect_format(d / 'model.bin') == 'llmc'
    jckpt.adapters.write({'jckpt': gpt2(3)}, tmp_path / 'converted.bin', format='llmc')
    assert (d / 'model.bin').read_bytes() == (tmp_path / 'converted.bin').read_bytes()
    record = json.loads((d / 'trainer_state.json').read_text())
    assert record['trainer_state']['global_step'] == 3 and record['metrics'] == {'loss': 1 / 3}
    assert record['model'] == 'model.bin' and record['model_namespace'] == 'model'
    assert r.step == 3 and r.trainer_state.consumed_batches == 12 and r.metrics == {'loss': 1 / 3}
    assert_trees_equal(r.tree['model'], gpt2(3))
    assert_trees_equal(r.tree['opt'], optimizer(3))


@pytest.mark.parametrize('fmt,name', [('safetensors', 'model.safetensors'), ('pth', 'model.pth'),
                                      ('npz', 'model.npz')])
def test_each_format_writes_and_restores_a_target(tmp_path, fmt, name):
    import jax.numpy as jnp
    model = {'w': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': {'x': np.int32(7)}}
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format=fmt)) as mgr:
        mgr.save(10, items={'model': model, 'opt': optimizer(1)})
        mgr.save(20, items={'model': model, 'opt': optimizer(2)})
        mgr.wait_durable()
        target = {'w': jnp.zeros((2, 3), jnp.float32), 'b': {'x': jnp.int32(0)}}
        both = {'model': target, 'opt': optimizer(0)}
        r = mgr.restore(target=both, namespaces=['model', 'opt'])
    assert sorted(os.listdir(tmp_path / 'step_00000020.jckpt')) == sorted(
        [name, 'optimizer.jckpt', 'trainer_state.json'])
    assert jckpt.detect_format(tmp_path / 'step_00000020.jckpt' / name) == \
        CheckpointOptions(format=fmt).format
    assert_trees_equal(r.tree['model'], model)
    assert_trees_equal(r.tree['opt'], optimizer(2))


def test_a_torch_steps_model_loads_into_a_torch_module(tmp_path):
    """The model file held nested dicts, which no nn.Module loads."""
    torch = pytest.importorskip('torch')
    model = {'encoder': {'weight': np.ones((3, 2), np.float32), 'bias': np.zeros(3, np.float32)}}
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='torch')) as mgr:
        mgr.save(1, items={'model': model, 'opt': optimizer(1)})
        mgr.wait_durable()
        r = mgr.restore(namespaces=['model'])
    module = torch.nn.Module()
    module.encoder = torch.nn.Linear(2, 3)
    module.load_state_dict(torch.load(tmp_path / 'step_00000001.jckpt' / 'model.pth',
                                      weights_only=True))
    assert module.encoder.weight.sum().item() == 6.0
    assert_trees_equal(r.tree['model'], model)


def test_a_whole_tree_is_the_model_and_a_target_fills_it(tmp_path):
    import jax
    import jax.numpy as jnp
    tree = {'w': jnp.full((3,), 2.0), 'n': jnp.int32(4)}
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='safetensors')) as mgr:
        mgr.save(5, tree, metrics={'loss': 0.5})
        mgr.wait_durable()
        assert sorted(os.listdir(tmp_path / 'step_00000005.jckpt')) == [
            'model.safetensors', 'trainer_state.json']  # no other namespace: no optimizer file
        r = mgr.restore(target={'w': jnp.zeros(3), 'n': jnp.int32(0)})
        assert isinstance(r.tree['w'], jax.Array) and float(r.tree['w'][1]) == 2.0
        with pytest.raises(MismatchError, match="step 5"):
            mgr.restore(target={'w': jnp.zeros(3, jnp.int32), 'n': jnp.int32(0)})
        assert mgr.restore(target={'w': jnp.zeros(3, jnp.int32), 'n': jnp.int32(0)},
                           cast=True).tree['w'].dtype == jnp.int32
        with pytest.raises(MismatchError, match="step 5"):
            mgr.restore(target={'w': jnp.zeros(4), 'n': jnp.int32(0)})


def test_per_save_options_mix_jckpt_files_and_step_directories(tmp_path):
    with jckpt.CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': optimizer(1)})
        mgr.save(2, items={'model': {'w': np.ones(2) * 2}, 'opt': optimizer(2)},
                 options=CheckpointOptions(format='npz'))
        mgr.save(3, items={'model': {'w': np.ones(2) * 3}, 'opt': optimizer(3)})
        mgr.wait_durable()
        assert os.path.isdir(tmp_path / 'step_00000002.jckpt')
        assert os.path.isfile(tmp_path / 'step_00000003.jckpt')
        assert mgr.restore(2).tree['model']['w'][0] == 2
    with jckpt.CheckpointManager(tmp_path) as mgr:  # reopened: the directory step counts, lineage holds
        assert mgr.all_steps() == [2, 3]
        mgr.save(4, items={'model': {'w': np.ones(2) * 4}, 'opt': optimizer(4)},
                 options=CheckpointOptions(format='npz'))
    with jckpt.CheckpointManager(tmp_path, keep_last=1) as mgr:
        assert mgr.latest_step() == 4
        mgr.save(5, items={'model': {'w': np.ones(2) * 5}, 'opt': optimizer(5)})
        mgr.wait_durable()
        assert mgr.all_steps() == [5]
    assert sorted(os.listdir(tmp_path)) == ['step_00000005.jckpt']


def test_save_optimizer_state_false_writes_only_the_model(tmp_path):
    opts = CheckpointOptions(format='npz', save_optimizer_state=False)
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': optimizer(1)})
        mgr.wait_durable()
        assert sorted(os.listdir(tmp_path / 'step_00000001.jckpt')) == ['model.npz', 'trainer_state.json']
        assert list(mgr.restore().tree) == ['model']
        with pytest.raises(MissingEntryError, match="step 1 has no namespace 'opt'"):
            mgr.restore(target={'opt': optimizer(0)}, namespaces=['opt'])


# --- callbacks ------------------------------------------------------------------------------------

def test_callbacks_write_and_read_the_model(tmp_path):
    calls = []

    def writer(tree, path):
        calls.append(('write', os.path.basename(path)))
        np.save(path + '.raw.npy', tree['w'])
        os.rename(path + '.raw.npy', path)

    def loader(path):
        calls.append(('load', os.path.basename(path)))
        return {'w': np.load(path)}

    opts = CheckpointOptions(format='raw', model_writer=writer)
    with jckpt.CheckpointManager(tmp_path, options=opts,
                                 load_options=CheckpointLoadOptions(model_loader=loader)) as mgr:
        mgr.save(1, items={'model': {'w': np.arange(3.0)}, 'opt': optimizer(1)})
        mgr.wait_durable()
        r = mgr.restore(target={'w': np.zeros(3)}, ctx=jckpt.Context(namespace='model'))
    assert calls == [('write', 'model.raw'), ('load', 'model.raw')]
    np.testing.assert_array_equal(r.tree['w'], np.arange(3.0))


# --- bad input ------------------------------------------------------------------------------------

def saved_steps(tmp_path, fmt='npz'):
    mgr = jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format=fmt), retry_after=0,
                                  patience=1)
    mgr.save(1, items={'model': {'w': np.ones(2)}, 'opt': optimizer(1)})
    mgr.save(2, items={'model': {'w': np.ones(2) * 2}, 'opt': optimizer(2)})
    mgr.wait_durable()
    return mgr


def test_a_callback_fault_of_its_own_drops_the_step(tmp_path):
    """A callback's KeyError was retried forever: every later step waited behind it."""
    def writer(tree, path):
        if float(tree['w'][0]) == 3:
            raise KeyError('w2')
        jckpt.adapters.write({'model': tree}, path, format='npz')

    with saved_steps(tmp_path) as mgr:
        opts = CheckpointOptions(format='npz', model_writer=writer)
        for step in (3, 4):
            mgr.save(step, items={'model': {'w': np.ones(2) * step}, 'opt': optimizer(step)},
                     options=opts)
        with pytest.raises(InputError, match="step 3: writing the model as npz: 'w2'") as e:
            mgr.wait_durable(timeout=60)
        assert e.value.file == str(tmp_path / 'step_00000003.jckpt' / 'model.npz')
        assert mgr.wait_durable(timeout=60) and mgr.all_steps() == [1, 2, 4]


@pytest.mark.parametrize('writes', ['nothing', 'a directory'])
def test_a_callback_that_writes_no_file_drops_the_step(tmp_path, writes):
    """It was retried forever: every later step waited behind it, and close lost them."""
    def writer(tree, path):
        if float(tree['w'][0]) == 3 and writes == 'a directory':
            os.makedirs(path)
        elif float(tree['w'][0]) != 3:
            jckpt.adapters.write({'model': tree}, path, format='npz')

    with saved_steps(tmp_path) as mgr:
        opts = CheckpointOptions(format='npz', model_writer=writer)
        for step in (3, 4):
            mgr.save(step, items={'model': {'w': np.ones(2) * step}, 'opt': optimizer(step)},
                     options=opts)
        what = 'a directory, not one file' if writes == 'a directory' else 'no file'
        with pytest.raises(InputError, match=f"step 3: the model writer wrote {what}") as e:
            mgr.wait_durable(timeout=60)
        assert e.value.file == str(tmp_path / 'step_00000003.jckpt' / 'model.npz')
        assert mgr.wait_durable(timeout=60) and mgr.all_steps() == [1, 2, 4]
        assert mgr.restore(4).tree['model']['w'][0] == 4


def test_a_callback_that_raises_is_a_failed_write(tmp_path):
    broken = [True]

    def writer(tree, path):
        if broken[0]:
            raise RuntimeError("disk on fire")
        jckpt.adapters.write({'model': tree}, path, format='npz')

    with saved_steps(tmp_path) as mgr:
        mgr.retry_after = 0.05
        mgr._pipeline.retry_after = 0.05
        mgr.save(3, items={'model': {'w': np.ones(2) * 3}, 'opt': optimizer(3)},
                 options=CheckpointOptions(format='npz', model_writer=writer))
        with pytest.raises(CheckpointError, match="step 3: writing the model as npz: disk on fire") as e:
            mgr.wait_durable()
        assert e.value.file == str(tmp_path / 'step_00000003.jckpt' / 'model.npz')
        assert mgr.counters.error == 'CheckpointError'
        assert mgr.all_steps() == [1, 2]
        assert not any('step_00000003' in n for n in os.listdir(tmp_path))  # no half step
        assert mgr.restore(2).tree['model']['w'][0] == 2
        broken[0] = False  # the write is retried, and succeeds once the writer works
        deadline = time.monotonic() + 60
        while mgr.counters.error and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mgr.wait_durable(timeout=60)
        assert mgr.all_steps() == [1, 2, 3] and mgr.counters.error == 0
        assert mgr.restore(3).tree['model']['w'][0] == 3


def test_llmc_is_checked_when_saved(tmp_path):
    """A tree that is not GPT-2's (names, shapes, one dtype) is refused by save, not dropped
    later by the writer."""
    import jax.numpy as jnp
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='llmc')) as mgr:
        with pytest.raises(InputError, match="step 1: the model cannot be written as llmc.*'h'"):
            mgr.save(1, {'w': jnp.ones(2)})
        wide = gpt2(1)
        wide['h'][1]['mlp']['c_fc']['bias'] = np.zeros(17, np.float32)
        with pytest.raises(InputError, match="fcb is float32\\[17\\]") as e:
            mgr.save(2, items={'model': wide, 'opt': optimizer(2)})
        assert e.value.entry == 'h/1/mlp/c_fc/bias'
        assert mgr.save(3, items={'model': gpt2(3), 'opt': optimizer(3)})
    assert jckpt.CheckpointManager(tmp_path).all_steps() == [3]


@pytest.mark.parametrize('fmt, bad', [
    ('safetensors', {'q': 'int4'}),         # a dtype safetensors lacks
    ('npz', {'a.b': 'float32'}),            # 'a.b' and a/b would share one member name
    ('npy', {'second': 'float32'}),         # .npy holds one array
    ('torch', {'q': 'int4'}),               # a dtype torch lacks
])
def test_a_model_its_format_cannot_hold_is_refused_when_saved(tmp_path, fmt, bad):
    """Found from shapes and dtypes (the format's check), before anything is admitted: it was
    found only when written, in the background, and retried forever."""
    import jax.numpy as jnp
    opts = CheckpointOptions(format=fmt)
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        mgr.save(1, {'w': jnp.ones(2)} if fmt == 'npy' else {'w': jnp.ones(2), 'a': {'b': jnp.ones(1)}})
        tree = {'w': jnp.ones(2), **{k: jnp.ones(4, getattr(jnp, d)) for k, d in bad.items()}}
        if fmt == 'npz':
            tree['a'] = {'b': jnp.ones(1)}
        with pytest.raises(InputError, match=f"step 2: the model cannot be written as {fmt}") as e:
            mgr.save(2, tree)
        assert e.value.file == str(tmp_path / 'step_00000002.jckpt' / CheckpointOptions(
            format=fmt).model_file) and e.value.fix
        assert mgr.counters.committed == 1
        mgr.save(3, {'w': jnp.ones(2)})
    assert jckpt.CheckpointManager(tmp_path).all_steps() == [1, 3]


@pytest.mark.parametrize('fmt', ['jckpt', 'safetensors'])
def test_a_tree_jax_cannot_flatten_is_an_input_error_naming_the_step(tmp_path, fmt):
    """Dict keys of two types ({'w': ..., 1: ...}) cannot be sorted by JAX: a step in another
    format raised JAX's bare ValueError from the format's check, and a jckpt step's error
    named no file."""
    import jax.numpy as jnp
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format=fmt)) as mgr:
        with pytest.raises(InputError, match="JAX cannot flatten the tree") as e:
            mgr.save(1, {'w': jnp.ones(2), 1: jnp.ones(1)})
        assert e.value.file == str(tmp_path / 'step_00000001.jckpt') and e.value.fix
        assert mgr.save(2, {'w': jnp.ones(2)})
    assert jckpt.CheckpointManager(tmp_path).all_steps() == [2]


def test_a_step_its_writer_refuses_later_is_dropped_and_later_steps_are_written(tmp_path,
                                                                                 monkeypatch):
    """What no check finds before writing (here an llm.c format registered without its check)
    is dropped when written: retrying cannot help, and retrying it forever held every later
    step behind it. The error keeps its class, names the step's file (not its staging name),
    and the next wait raises it once."""
    import jax.numpy as jnp

    from jckpt import adapters
    unchecked = dataclasses.replace(adapters.get_format('llmc'), check=None)
    monkeypatch.setattr(adapters, 'get_format', lambda name, file=None: unchecked)
    opts = CheckpointOptions(format='llmc')
    with jckpt.CheckpointManager(tmp_path, options=opts, retry_after=30, patience=1) as mgr:
        assert mgr.save(1, {'w': jnp.ones(2)})
        assert mgr.save(2, items={'model': gpt2(2), 'opt': optimizer(2)}, timeout=60)
        with pytest.raises(InputError, match="step 1: writing the model as llmc") as e:
            mgr.wait_durable(timeout=60)
        assert e.value.file == str(tmp_path / 'step_00000001.jckpt' / 'model.bin')
        assert mgr.all_steps() == [2] and mgr.counters.failures == 1
        assert mgr.wait_durable(timeout=60)  # raised once
    assert not [n for n in os.listdir(tmp_path) if 'step_00000001' in n]


def test_a_model_namespace_is_needed_and_multi_process_steps_stay_jckpt(tmp_path):
    with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='npz')) as mgr:
        with pytest.raises(InputError, match="no model namespace 'model'"):
            mgr.save(1, items={'params': {'w': np.ones(2)}})
        assert mgr.save(1, items={'params': {'w': np.ones(2)}},
                        options=CheckpointOptions(format='npz', model_namespace='params'))
    with jckpt.CheckpointManager(tmp_path / 'mp', directory_steps=True) as mgr:
        with pytest.raises(InputError, match="directory steps are jckpt only"):
            mgr.save(1, {'w': np.ones(2)}, options=CheckpointOptions(format='npz'))


def test_a_manager_of_directory_steps_refuses_another_format_when_opened(tmp_path):
    """It was taken, and every save refused, so a misconfigured run of several processes found
    out at its first save, a save interval of training later."""
    with pytest.raises(InputError, match="directory steps are jckpt only.*'safetensors'") as e:
        jckpt.CheckpointManager(tmp_path, directory_steps=True,
                                options=CheckpointOptions(format='safetensors'))
    assert e.value.file == str(tmp_path) and 'format="jckpt"' in e.value.fix
    assert not [n for n in os.listdir(tmp_path) if n.startswith('.jckpt-lease')]  # none held
    jckpt.CheckpointManager(tmp_path, read_only=True,  # a reader writes nothing: any options
                            options=CheckpointOptions(format='safetensors')).close()


def test_staged_and_half_deleted_step_directories_are_cleared_on_open(tmp_path):
    with saved_steps(tmp_path) as mgr:
        pass
    staged = tmp_path / 'step_00000003.jckpt.jckpt-next.7'
    staged.mkdir()
    (staged / 'model.npz').write_bytes(b'half')
    half = tmp_path / 'step_00000004.jckpt'
    half.mkdir()
    (half / 'optimizer.jckpt').write_bytes(b'')
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ['step_00000001.jckpt', 'step_00000002.jckpt']


KILLED_WRITER = r'''
import sys, time
import numpy as np
import jckpt
from jckpt.services.formats import CheckpointOptions

def stuck(tree, path):
    with open(path, 'wb') as f:
        f.write(b'half a model')
    print('writing', flush=True)
    time.sleep(600)

mgr = jckpt.CheckpointManager(sys.argv[1], options=CheckpointOptions(format='npz'))
mgr.save(1, items={'model': {'w': np.ones(2, np.float32)}, 'opt': {'m': np.zeros(2, np.float32)}})
mgr.wait_durable()
mgr.save(2, items={'model': {'w': np.ones(2, np.float32) * 2}, 'opt': {'m': np.zeros(2, np.float32)}},
         options=CheckpointOptions(format='npz', model_writer=stuck))
time.sleep(600)
'''


def test_a_kill_during_a_step_leaves_the_previous_step_and_no_half_step(tmp_path):
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(jckpt.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get('PYTHONPATH', '')]))
    child = subprocess.Popen([sys.executable, '-c', KILLED_WRITER, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == 'writing'
        assert any('jckpt-next' in n for n in os.listdir(tmp_path))  # step 2 is being staged
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not (tmp_path / 'step_00000002.jckpt').exists()  # no half step visible
    with jckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.restore().tree['model']['w'][0] == 1
        mgr.save(2, {'w': np.ones(2)})
    assert sorted(os.listdir(tmp_path)) == ['step_00000001.jckpt', 'step_00000002.jckpt']


def test_step_directories_carry_the_lineage_and_the_lease(tmp_path):
    from jckpt.errors import InUseError, LineageError
    opts = CheckpointOptions(format='npz')
    with jckpt.CheckpointManager(tmp_path, options=opts, lineage='run-a') as mgr:
        mgr.save(1, {'w': np.ones(2, np.float32)})
        mgr.wait_durable()
        with pytest.raises(InUseError):
            jckpt.CheckpointManager(tmp_path, options=opts)
    record = json.loads((tmp_path / 'step_00000001.jckpt' / 'trainer_state.json').read_text())
    assert record['metadata']['jckpt.lineage'] == 'run-a'
    with pytest.raises(LineageError):
        jckpt.CheckpointManager(tmp_path, lineage='run-b')
    with jckpt.CheckpointManager(tmp_path, options=opts) as mgr:
        assert mgr.lineage == 'run-a' and mgr.counters.generation == 1
        mgr.save(2, {'w': np.ones(2, np.float32)})
    assert json.loads((tmp_path / 'step_00000002.jckpt' / 'trainer_state.json').read_text())[
        'metadata']['jckpt.generation'] == '2'


def test_a_format_that_writes_a_directory_is_refused_up_front():
    with pytest.raises(jckpt.InputError, match="writes a directory"):
        jckpt.CheckpointOptions(format="orbax")


def test_a_model_like_one_that_passed_is_not_checked_again(monkeypatch):
    """The check runs on the training loop's time: step after step of one structure is checked
    once; another dtype or shape is checked anew."""
    from jckpt import adapters
    from jckpt.services import formats
    calls = []
    fmt = dataclasses.replace(adapters.get_format('npz'), check=lambda t, p: calls.append(p))
    monkeypatch.setattr(adapters, 'get_format', lambda name, file=None: fmt)
    opts = CheckpointOptions(format='npz')
    for step, w in enumerate([np.ones(2), np.zeros(2), np.ones(2, np.int32), np.ones(3)]):
        formats.check_model(opts, {'m': {'w': w}}, 'm', step, f'run/{step}')
    assert len(calls) == 3  # the second had the first's structure, dtype and shape


def test_an_npy_model_is_warned_of_once_naming_the_step_not_its_staging(tmp_path):
    """A manager writing its model as npy warned, from the writer, naming the staged file (a
    temporary name the user never sees) and saying the array reads back under namespace
    'jckpt', for every step. The manager warns once, naming the step and its file, and says
    what restore does: bare without a target, under its name with a target of one leaf."""
    import warnings

    w = np.arange(15, dtype=np.float32).reshape(3, 5)  # a structure no other test checked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with jckpt.CheckpointManager(tmp_path, options=CheckpointOptions(format='npy')) as mgr:
            mgr.save(1, {'w': w})
            mgr.save(2, {'w': w + 1})
            mgr.wait_durable()
            assert np.array_equal(mgr.restore(2, {'w': np.zeros((3, 5), np.float32)}).tree['w'], w + 1)
    said = [str(c.message) for c in caught if 'no name' in str(c.message)]
    assert len(said) == 1 and '.jckpt-next' not in said[0], said
    assert said[0].startswith('step 1: the model, jckpt/w, is written to ')
    assert str(tmp_path / 'step_00000001.jckpt' / 'model.npy') in said[0]
    assert 'without a target gives the bare array' in said[0] and 'target of one leaf' in said[0]
