"""`jckpt.restore` and `jckpt.load` read orbax directories directly, with no conversion step."""

import json
import os

import numpy as np
import pytest

ocp = pytest.importorskip('orbax.checkpoint')
optax = pytest.importorskip('optax')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jckpt  # noqa: E402
from jckpt.errors import FormatError, MissingEntryError  # noqa: E402
from jckpt.format.names import ORBAX_JSON_KEY  # noqa: E402

CTX = jckpt.Context()


def adamw_state():
    params = {'w': jnp.arange(6.0).reshape(2, 3), 'b': jnp.ones(3)}
    tx = optax.adamw(1e-3)
    state = tx.init(params)
    _, state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), state, params)
    return params, state


def same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_an_optax_state_straight_from_a_standard_checkpointer_directory(tmp_path):
    _, state = adamw_state()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / 'opt', state)
    back = jckpt.restore(CTX, jax.eval_shape(lambda: state), tmp_path / 'opt')
    same(back, state)  # the NamedTuples and the EmptyStates, from the target's structure
    assert type(back[0]).__name__ == 'ScaleByAdamState' and type(back[1]).__name__ == 'EmptyState'
    assert isinstance(back[0].mu['w'], jax.Array)
    assert sorted(os.listdir(tmp_path)) == ['opt']  # read-only: nothing written beside it


def test_restore_a_flax_train_state_from_a_manager_step(tmp_path):
    train_state = pytest.importorskip('flax.training.train_state')
    params, _ = adamw_state()
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave({'lr': 0.001, 'seed': 7})))
        manager.wait_until_finished()
    abstract = jax.eval_shape(lambda: state)
    back = jckpt.restore(CTX, abstract, tmp_path / 'run' / '3', namespace='state')
    assert type(back) is type(state) and int(back.step) == 0
    same(back.params, state.params)
    same(back.opt_state, state.opt_state)
    # the JSON item is in the header's metadata, and convert keeps it
    assert json.loads(jckpt.describe(tmp_path / 'run' / '3').metadata_dict()[ORBAX_JSON_KEY]) == \
        {'meta': {'lr': 0.001, 'seed': 7}}
    jckpt.convert(tmp_path / 'run' / '3', tmp_path / 'c.jckpt')
    assert json.loads(jckpt.describe(tmp_path / 'c.jckpt').metadata_dict()[ORBAX_JSON_KEY]) == \
        {'meta': {'lr': 0.001, 'seed': 7}}
    with pytest.warns(UserWarning, match=r"orbax_json.*not kept in 'npz'"):
        jckpt.convert(tmp_path / 'run' / '3', tmp_path / 'c.npz')


def test_load_an_orbax_step_as_namespaces(tmp_path):
    params, state = adamw_state()
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                opt=ocp.args.StandardSave(state)))
        manager.wait_until_finished()
    _, tree = jckpt.load(CTX, tmp_path / 'run' / '1', namespaces='params')
    assert list(tree) == ['params']
    same(tree['params'], params)
    both = jckpt.restore(CTX, {'params': jax.eval_shape(lambda: params),
                               'opt': jax.eval_shape(lambda: state)},
                         tmp_path / 'run' / '1', namespaces=['params', 'opt'])
    same(both['opt'], state)


def test_typed_keys_and_partial_targets(tmp_path):
    tree = {'rng': jax.random.key(4), 'w': jnp.arange(3.0), 'b': jnp.zeros(2, jnp.bfloat16)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / 'k', tree)
    back = jckpt.restore(CTX, {'rng': jax.eval_shape(lambda: tree['rng'])}, tmp_path / 'k')
    assert jax.dtypes.issubdtype(back['rng'].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back['rng']), jax.random.key_data(tree['rng']))
    with pytest.raises(MissingEntryError, match='not in the checkpoint'):
        jckpt.restore(CTX, {'nope': jnp.zeros(2)}, tmp_path / 'k')


def test_a_manager_root_names_a_step_and_a_damaged_item_is_refused(tmp_path):
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': jnp.ones(2)})))
        manager.wait_until_finished()
    with pytest.raises(FormatError, match=r"holds no orbax checkpoint item") as e:
        jckpt.restore(CTX, {'w': jnp.zeros(2)}, tmp_path / 'run')
    assert os.path.join(str(tmp_path / 'run'), '2') in e.value.fix
    os.remove(tmp_path / 'run' / '2' / 'state' / '_METADATA')
    os.remove(tmp_path / 'run' / '2' / 'state' / 'manifest.ocdbt')
    with pytest.raises(FormatError):
        jckpt.restore(CTX, {'w': jnp.zeros(2)}, tmp_path / 'run' / '2', namespace='state')


def test_a_manager_root_with_prefixed_padded_step_names_names_its_step(tmp_path, caplog):
    """orbax names steps `<step_prefix>_<step>`, zero-padded with `step_format_fixed_length`:
    such a root was told "no index.jckpt ... convert it", which fails too, and jckpt's manager
    opened on it said nothing of the orbax steps there."""
    import logging

    from jckpt.tools.classify import classify
    options = ocp.CheckpointManagerOptions(step_prefix='ckpt', step_format_fixed_length=6)
    with ocp.CheckpointManager(tmp_path / 'run', options=options) as manager:
        for step in (7, 100):
            manager.save(step, args=ocp.args.StandardSave({'w': jnp.full(2, step, jnp.float32)}))
        manager.wait_until_finished()
    step_dir = os.path.join(str(tmp_path / 'run'), 'ckpt_000100')
    with pytest.raises(FormatError, match=r"holds no orbax checkpoint item") as e:
        jckpt.restore(CTX, {'w': jnp.zeros(2)}, tmp_path / 'run')
    assert step_dir in e.value.fix
    back = jckpt.restore(CTX, {'w': jnp.zeros(2)}, step_dir, namespace='default')  # as the fix says
    assert back['w'].tolist() == [100, 100]
    assert classify(str(tmp_path / 'run')).error.message.startswith(
        'this directory holds orbax steps (ckpt_000007, ckpt_000100)')
    with caplog.at_level(logging.WARNING, logger='jckpt'):
        with jckpt.CheckpointManager(tmp_path / 'run') as mgr:
            assert mgr.all_steps() == []
    assert 'holds orbax steps [7, 100] and no jckpt steps' in caplog.text and step_dir in caplog.text


def test_a_json_item_that_is_not_json_is_refused(tmp_path):
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': jnp.ones(2)}),
                                                meta=ocp.args.JsonSave({'a': 1})))
        manager.wait_until_finished()
    (tmp_path / 'run' / '0' / 'meta' / 'metadata').write_text('{"a": ')
    with pytest.raises(FormatError, match="JSON item 'meta' cannot be read"):
        jckpt.describe(tmp_path / 'run' / '0')


def test_only_the_items_asked_for_are_read(tmp_path, monkeypatch):
    from jckpt.adapters import orbax

    params, state = adamw_state()
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                opt=ocp.args.StandardSave(state)))
        manager.wait_until_finished()
    step = tmp_path / 'run' / '1'
    read = []
    real = orbax.read_item
    monkeypatch.setattr(orbax, 'read_item', lambda item, checked=None: read.append(
        os.path.basename(item)) or real(item, checked))
    header = jckpt.describe(step)  # from the metadata alone
    assert {e.namespace for e in header.tensors} == {'params', 'opt'} and read == []
    back = jckpt.restore(CTX, {'params': jax.eval_shape(lambda: params)}, step,
                         namespaces=['params'])
    same(back['params'], params)
    assert read == ['params']


def test_data_that_does_not_match_the_metadata_is_refused(tmp_path, monkeypatch):
    from jckpt.adapters import orbax

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / 'w', {'w': jnp.ones(3)})
    specs = orbax.item_specs
    monkeypatch.setattr(orbax, 'item_specs', lambda item: [
        (kp, (4,), dtype, impl) for kp, _, dtype, impl in specs(item)])
    with pytest.raises(FormatError, match=r"metadata lists float32\[4\] here, its data holds "
                                          r"float32\[3\]"):
        jckpt.restore(CTX, {'w': jax.ShapeDtypeStruct((4,), jnp.float32)}, tmp_path / 'w')


def test_an_orbax_directory_in_a_bucket_is_refused_with_what_to_do(tmp_path, s3):
    """orbax reads local directories here: one in a bucket is a clear error, for every reader."""
    from jckpt.adapters import orbax_handler
    from jckpt.storage import backend_for

    params, _ = adamw_state()
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(4, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                state=orbax_handler.JckptSave(params)))
    step, url = tmp_path / 'run' / '4', f"{s3}/run/4"
    for root, _, files in os.walk(step):
        for name in files:
            local = os.path.join(root, name)
            backend_for(url).upload(local, f"{url}/{os.path.relpath(local, step)}")
    target = jax.eval_shape(lambda: params)
    for attempt in (lambda: jckpt.restore(CTX, {'params': target}, url),
                    lambda: jckpt.describe(url), lambda: jckpt.convert(url, tmp_path / 'x.jckpt'),
                    lambda: jckpt.restore(CTX, target, f"{url}/params")):
        with pytest.raises(FormatError, match='an orbax checkpoint in an object store is not read '
                                              'in place') as err:
            attempt()
        assert err.value.file.startswith(url) and 'copy it to a local directory first' in err.value.fix
    # the item jckpt's handler wrote is a jckpt file: it restores in place, as the fix says
    same(jckpt.restore(CTX, target, f"{url}/state/{orbax_handler.FILENAME}"), params)
    assert not (tmp_path / 'x.jckpt').exists()


def _item(tmp_path, name='item', **save):
    path = tmp_path / name
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {'w': jnp.arange(4.0)}, **save)
    return path


@pytest.mark.parametrize('plant', ['link out', 'link to /dev/zero', 'fifo'])
def test_links_and_special_files_in_an_orbax_checkpoint_are_refused(tmp_path, plant):
    """orbax writes none: one could lead out of the checkpoint, never end, or block."""
    item = _item(tmp_path)
    outside = _item(tmp_path, 'outside')
    victim = item / '_CHECKPOINT_METADATA'
    victim.unlink()
    if plant == 'link out':
        victim.symlink_to(outside / '_CHECKPOINT_METADATA')
    elif plant == 'fifo':
        os.mkfifo(victim)
    else:
        victim.symlink_to('/dev/zero')
    for read in (lambda p: jckpt.load(jckpt.Context(host=True), p), jckpt.describe,
                 lambda p: jckpt.convert(p, tmp_path / 'out.jckpt')):
        with pytest.raises(FormatError, match='symbolic link|not a regular file') as e:
            read(item)
        assert e.value.file == str(victim)


def test_a_zarr_shape_past_what_the_files_hold_is_refused_before_allocating(tmp_path, monkeypatch):
    """tensorstore allocates a zarr array whole: a shape the files cannot hold is refused first."""
    from jckpt.adapters import orbax as orbax_adapter
    monkeypatch.setattr(orbax_adapter, 'memory_bytes', lambda: 1 << 30)  # on any machine
    item = tmp_path / 'item'  # an item without OCDBT: one zarr array per leaf
    (item / 'w').mkdir(parents=True)
    (item / '_METADATA').write_text('{}')
    (item / 'w' / '.zarray').write_text('{"shape": [17179869184], "dtype": "<f4"}')
    with pytest.raises(FormatError, match='of 68719476736 bytes claimed by a checkpoint of') as e:
        jckpt.load(jckpt.Context(host=True), item)
    assert e.value.file == str(item / 'w' / '.zarray')
    (item / 'w' / '.zarray').write_text('{"shape": [-1], "dtype": "<f4"}')
    with pytest.raises(FormatError, match='zarr metadata cannot be read'):
        jckpt.describe(item)


_READ_IN_A_CHILD = """
import resource, sys
import jckpt, orbax.checkpoint
from jckpt.errors import CheckpointError
with open('/proc/self/statm') as f:  # what the hostile fuzzer's children may take
    vm = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
for path in sys.argv[1:]:
    try:
        jckpt.load(jckpt.Context(host=True), path)
        print('read')
    except CheckpointError as e:
        print('refused', e.file)
"""


def test_zarr_sizes_tensorstore_would_abort_on_are_refused_before_it_reads(tmp_path):
    """tensorstore allocates an array, and a chunk, whole at the `.zarray`'s sizes; an
    allocation that fails there aborts the process (SIGABRT): a chunk larger than its array,
    or an array past what an address-space limit leaves, is refused first. In a child, which
    the old code took down."""
    import subprocess
    import sys
    paths, files = [], []
    huge = {'configuration': {'chunk_shape': [1 << 40, 4]}}
    for name, edit in [('chunk', {'chunks': [1 << 40, 4]}),
                       ('limit', {'shape': [1 << 28, 4], 'chunks': [1 << 28, 4]}),
                       ('zarr3', {'chunk_grid': huge, 'codecs': [{'name': 'sharding_indexed',
                                                                  **huge}]})]:
        path = os.path.abspath(tmp_path / name)
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=name == 'zarr3')
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave({'w': np.ones((3, 4), np.float32)}))
        zarray = os.path.join(path, 'w', 'zarr.json' if name == 'zarr3' else '.zarray')
        with open(zarray) as f:
            meta = json.load(f)
        with open(zarray, 'w') as f:
            json.dump({**meta, **edit}, f)
        paths.append(path)
        files.append(zarray)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, '-c', _READ_IN_A_CHILD, *paths], capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, 'PYTHONPATH': root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split('\n')[:3] == [f"refused {file}" for file in files]


def test_array_metadata_nested_too_deep_reads_as_no_keys(tmp_path):
    item = _item(tmp_path)
    folder = item / 'array_metadatas'
    folder.mkdir(exist_ok=True)
    (folder / 'process_0').write_text('[' * 100_000 + ']' * 100_000)
    _, tree = jckpt.load(jckpt.Context(host=True), item)
    assert tree['jckpt']['w'].tolist() == [0, 1, 2, 3]


def test_arrays_the_metadata_claims_past_what_the_files_hold_are_refused_before_reading(
        tmp_path, monkeypatch):
    """An OCDBT item keeps its shapes in orbax's metadata: checked before tensorstore allocates."""
    from jckpt.adapters import orbax as orbax_adapter
    monkeypatch.setattr(orbax_adapter, 'memory_bytes', lambda: 1 << 30)  # on any machine
    item = _item(tmp_path)
    real = orbax_adapter.item_specs
    monkeypatch.setattr(orbax_adapter, 'item_specs', lambda i: [
        (kp, (1 << 40,), dtype, impl) for kp, _, dtype, impl in real(i)])
    with pytest.raises(FormatError, match='claimed by a checkpoint of') as e:
        orbax_adapter.read_item(str(item))
    assert e.value.file == str(item)


def test_a_restore_asks_orbax_for_the_metadata_once(tmp_path, monkeypatch):
    """Opening, checking and reading an item each asked for it: three times, about a second
    each for a few thousand leaves (a restore took twice orbax's own)."""
    from jckpt.adapters import orbax as orbax_adapter
    tree = {f"l{i}": np.full(3, i, np.float32) for i in range(20)}
    path = os.path.abspath(tmp_path / 'std')
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
    asked = []
    real = ocp.PyTreeCheckpointer.metadata
    monkeypatch.setattr(ocp.PyTreeCheckpointer, 'metadata',
                        lambda self, *a, **k: (asked.append(1), real(self, *a, **k))[1])
    orbax_adapter._metadata_of.cache_clear()
    back = jckpt.restore(jckpt.Context(host=True), tree, path)
    assert len(asked) == 1 and back['l7'].tolist() == [7, 7, 7]


def test_an_item_with_string_and_python_number_leaves_reads_its_arrays(tmp_path):
    """orbax's PyTreeSave stores a string leaf (a run name) beside the arrays, and Python
    numbers as scalars: the arrays and numbers read; the strings, which are not arrays, are
    left out with a warning naming them (orbax's own restore reads them)."""
    tree = {'w': jnp.arange(3.0), 'step': 5, 'lr': 0.5, 'run': 'run-1', 'cfg': {'tag': 'x'}}
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / 'item', args=ocp.args.PyTreeSave(tree))
    assert [e.name for e in jckpt.describe(tmp_path / 'item').tensors] == [
        'jckpt/lr', 'jckpt/step', 'jckpt/w']
    with pytest.warns(UserWarning, match=r"string leaves \['cfg.tag', 'run'\] are not arrays"):
        back = jckpt.restore(CTX, jax.eval_shape(lambda: {'w': tree['w'], 'step': 5, 'lr': 0.5}),
                             tmp_path / 'item')
    np.testing.assert_array_equal(back['w'], np.arange(3.0))
    assert int(back['step']) == 5 and float(back['lr']) == 0.5
    with pytest.warns(UserWarning, match="string leaves"):
        jckpt.convert(tmp_path / 'item', tmp_path / 'c.jckpt')
    assert [e.name for e in jckpt.describe(tmp_path / 'c.jckpt').tensors] == [
        'jckpt/lr', 'jckpt/step', 'jckpt/w']


def test_a_restore_or_load_of_a_step_walks_it_once_and_bounds_each_item_by_its_own_bytes(
        tmp_path, monkeypatch):
    """Each item read was walked and checked again after the step was: the step's files
    are walked once, and an item's claimed sizes still checked against its own files."""
    from jckpt.adapters import orbax as orbax_adapter
    params, state = adamw_state()
    step = tmp_path / 'step'
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(step, ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                   opt=ocp.args.StandardSave(state)))
    walks, bounds = [], {}
    real_walk, real_read = orbax_adapter.check_tree, orbax_adapter.read_item
    monkeypatch.setattr(orbax_adapter, 'check_tree',
                        lambda path, *items: walks.append(path) or real_walk(path, *items))
    monkeypatch.setattr(orbax_adapter, 'read_item', lambda item, checked=None: bounds.update(
        {os.path.basename(item): checked}) or real_read(item, checked))
    same(jckpt.restore(CTX, {'params': jax.eval_shape(lambda: params),
                             'opt': jax.eval_shape(lambda: state)}, step,
                       namespaces=['params', 'opt']),
         {'params': params, 'opt': state})
    assert walks == [str(step)]
    own = {n: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step / n) for f in fs)
           for n in ('params', 'opt')}
    assert bounds == own
    walks.clear()
    same(jckpt.load(CTX, step, namespaces='params')[1]['params'], params)
    assert walks == [str(step)]


def test_arrays_of_zeros_orbax_stored_as_no_chunk_are_read(tmp_path, monkeypatch):
    """tensorstore writes no chunk that is all zeros: 64 MiB of zeros (an optimizer's moments
    at step 0) in 40 KiB of files were refused as a decompression bomb. Claims past what the
    files hold pass where they fit in half the memory, and only there."""
    from jckpt.adapters import orbax as orbax_adapter
    path = os.path.abspath(tmp_path / 'zeros')
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {'mu': np.zeros((16, 1 << 20), np.float32), 'w': np.ones(3)})
    tree = jckpt.adapters.read(path)['jckpt']  # 64 MiB: within half of any machine's memory
    assert tree['mu'].shape == (16, 1 << 20) and not tree['mu'].any()
    assert tree['w'].tolist() == [1, 1, 1]
    monkeypatch.setattr(orbax_adapter, 'memory_bytes', lambda: 1 << 26)
    with pytest.raises(FormatError, match='more than half this machine.s memory'):
        jckpt.adapters.read(path)
