"""orbax interop with the real orbax-checkpoint: the jckpt handler in CheckpointManager, and
converting orbax PyTree checkpoints to jckpt files and back."""

import importlib
import json
import os
import threading

import ml_dtypes
import numpy as np
import pytest

ocp = pytest.importorskip('orbax.checkpoint')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jckpt  # noqa: E402
import jckpt.adapters  # noqa: E402
from jckpt.adapters import orbax_handler  # noqa: E402
from jckpt.errors import FormatError  # noqa: E402
from tests.helpers import cpu_mesh  # noqa: E402


def state():
    mesh = cpu_mesh((4,), ('x',))
    sharded = jax.device_put(jnp.arange(16.0).reshape(4, 4),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x')))
    return {'params': {'w': sharded, 'b': jnp.ones(3, jnp.bfloat16)},
            'opt': [np.arange(5, dtype=np.int32)], 'step': 7}


def test_manager_saves_and_restores_through_jckpt(tmp_path):
    tree = state()
    with ocp.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.Composite(state=orbax_handler.JckptSave(tree)))
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2]
    item = tmp_path / '2' / 'state' / orbax_handler.FILENAME
    assert jckpt.detect_format(item) == 'jckpt'
    meta = json.loads((tmp_path / '2' / '_CHECKPOINT_METADATA').read_text())
    type_string = meta['item_handlers']['state']
    module, _, name = type_string.rpartition('.')
    handler = getattr(importlib.import_module(module), name)()  # importable, no arguments
    assert isinstance(handler, orbax_handler.JckptCheckpointHandler)

    target = jax.tree_util.tree_map(lambda x: x, tree)
    target['params']['w'] = jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=tree['params']['w'].sharding)
    with ocp.CheckpointManager(tmp_path) as fresh:
        restored = fresh.restore(2, args=ocp.args.Composite(state=orbax_handler.JckptRestore(target)))
        whole = fresh.restore(1)  # without args: orbax finds the handler from its type string
    got = restored['state']
    assert got['params']['w'].sharding == tree['params']['w'].sharding
    assert np.array_equal(got['params']['w'], tree['params']['w'])
    assert got['params']['b'].dtype == jnp.bfloat16 and got['step'] == 7
    assert np.array_equal(got['opt'][0], tree['opt'][0])
    assert np.array_equal(whole['state']['params']['w'], tree['params']['w'])


def test_item_metadata_describes_a_jckpt_item_as_an_abstract_tree(tmp_path):
    tree = {'params': {'w': jnp.ones((2, 3), jnp.bfloat16)}, 'opt': [jnp.zeros(4, jnp.int32)],
            'rng': jax.random.key(1, impl='rbg'), 'step': 3}
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(5, args=ocp.args.Composite(state=orbax_handler.JckptSave(tree)))
        manager.wait_until_finished()
        assert isinstance(manager.item_metadata(5)['state'], orbax_handler.JckptItemMetadata)
    # as for orbax's own items, a fresh manager is told the item's handler
    handlers = {'state': orbax_handler.JckptCheckpointHandler()}
    with ocp.CheckpointManager(tmp_path, item_handlers=handlers) as fresh:
        meta = fresh.item_metadata(5)['state']
        assert isinstance(meta, orbax_handler.JckptItemMetadata)
        assert meta.tree['params']['w'] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
        assert meta.tree['opt'][0] == jax.ShapeDtypeStruct((4,), jnp.int32)
        assert meta.tree['rng'] == jax.eval_shape(lambda: tree['rng'])  # a typed key stays one
        assert meta.tree['step'].shape == () and meta.header.tensors
        # the metadata's tree is a target restore takes as it is
        got = fresh.restore(5, args=ocp.args.Composite(
            state=orbax_handler.JckptRestore(meta.tree)))['state']
    assert got['params']['w'].dtype == jnp.bfloat16 and int(got['step']) == 3
    np.testing.assert_array_equal(jax.random.key_data(got['rng']), jax.random.key_data(tree['rng']))
    handler = orbax_handler.JckptCheckpointHandler()
    assert handler.metadata(tmp_path / '5' / 'state').custom_metadata == {}


def test_save_is_asynchronous_and_snapshots_the_tree(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    real_save = orbax_handler.save_file

    def slow_save(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(orbax_handler, 'save_file', slow_save)
    values = np.arange(6, dtype=np.float32)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.Composite(state=orbax_handler.JckptSave({'v': values})))
        # save returned while the file is still being written in the background
        assert started.wait(60)
        assert not (tmp_path / '1' / 'state' / orbax_handler.FILENAME).exists()
        values[:] = -1  # the caller may change its arrays at once
        release.set()
        manager.wait_until_finished()
        got = manager.restore(1, args=ocp.args.Composite(state=orbax_handler.JckptRestore()))
    assert got['state']['v'].tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_save_images_jax_arrays_on_their_device_before_they_are_donated(tmp_path):
    tree = {'w': jnp.arange(6.0), 'key': jax.random.key(3), 'n': np.arange(3)}
    want = {'w': np.arange(6.0, dtype=np.float32), 'key': np.asarray(jax.random.key_data(tree['key'])),
            'n': np.arange(3)}
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.Composite(state=orbax_handler.JckptSave(tree)))
        step = jax.jit(lambda t: {'w': t['w'] * 0 - 1, 'key': t['key']}, donate_argnums=0)
        jax.block_until_ready(step({'w': tree['w'], 'key': tree['key']}))
        tree['n'][:] = -1
        manager.wait_until_finished()
        got = manager.restore(1, args=ocp.args.Composite(state=orbax_handler.JckptRestore()))['state']
    assert got['w'].tolist() == want['w'].tolist() and got['n'].tolist() == want['n'].tolist()
    assert np.asarray(jax.random.key_data(got['key'])).tolist() == want['key'].tolist()


@pytest.fixture(scope='module')
def orbax_tree():
    return {'a': np.arange(12, dtype=np.float32).reshape(3, 4),
            'nested': {'bf16': np.arange(4).astype(ml_dtypes.bfloat16),
                       'i64': np.array([-1, 2**40], np.int64)},
            'layers': [np.ones(2, np.float16), np.zeros((2, 2), np.uint8)]}


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same(tree, back):
    flat_a = jax.tree_util.tree_leaves_with_path(tree)
    flat_b = jax.tree_util.tree_leaves_with_path(back)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (p, a), (_, b) in zip(flat_a, flat_b):
        assert same_bits(a, b), p


def test_orbax_pytree_checkpoint_to_jckpt_and_back(tmp_path, orbax_tree):
    item = tmp_path / 'item'
    ocp.PyTreeCheckpointer().save(item, orbax_tree)
    assert jckpt.detect_format(item) == 'orbax'
    out = tmp_path / 'from_orbax.jckpt'
    assert jckpt.convert(item, out) == ('orbax', 'jckpt')
    _, loaded = jckpt.load(jckpt.Context(host=True), out)
    assert_same(orbax_tree, loaded['jckpt'])

    back = tmp_path / 'to_orbax'
    assert jckpt.convert(out, back, format='orbax') == ('jckpt', 'orbax')
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                          orbax_tree)
    theirs = ocp.PyTreeCheckpointer().restore(back / 'jckpt', args=ocp.args.PyTreeRestore(
        restore_args=restore_args))
    assert_same(orbax_tree, theirs)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        composite = checkpointer.restore(back, args=ocp.args.Composite(
            jckpt=ocp.args.PyTreeRestore(restore_args=restore_args)))
    assert_same(orbax_tree, composite['jckpt'])


@pytest.mark.parametrize('tree, entry, words', [
    ({'a.b': np.zeros(3, np.float32), 'a': {'b': np.ones(3, np.float32)}}, 'jckpt/a.b',
     "both be stored as 'a.b'"),  # orbax joins names with '.': one value was silently lost
    # tensorstore ends a name with '/': both leaves read back the one written last
    ({'a': np.ones(2), 'a/': np.zeros(2)}, 'jckpt/a/', "'a' and 'a/' would be one array"),
    ({'': np.ones(2), '/': np.zeros(2)}, 'jckpt//', "'' and '/' would be one array"),
    ({'x': {'a': np.ones(2)}, 'x.a/': np.zeros(2)}, 'jckpt/x.a/', "would be one array"),
    ({'w': np.ones(2), 'empty': np.zeros((3, 0))}, 'jckpt/empty', 'no elements'),
    ({'w': np.ones(2, ml_dtypes.uint4)}, 'jckpt/w', 'no tensorstore equivalent'),
])
def test_what_orbax_cannot_hold_is_refused_naming_the_leaf(tmp_path, tree, entry, words):
    out = tmp_path / 'o'
    with pytest.raises(jckpt.InputError, match=words) as e:
        jckpt.adapters.write({'jckpt': tree}, out, format='orbax')
    assert e.value.entry == entry and list(tmp_path.iterdir()) == []
    with pytest.raises(jckpt.InputError, match=words):
        jckpt.adapters.get_format('orbax').check({'jckpt': tree}, out)


def test_checking_for_orbax_without_orbax_says_what_to_install(monkeypatch):
    """The check asked tensorstore first: a ModuleNotFoundError, not the InputError."""
    import sys
    monkeypatch.setitem(sys.modules, 'orbax.checkpoint', None)
    monkeypatch.setitem(sys.modules, 'tensorstore', None)
    with pytest.raises(jckpt.InputError, match="needs orbax-checkpoint"):
        jckpt.adapters.get_format('orbax').check({'jckpt': {'w': np.ones(2)}}, 'out')


def test_the_same_names_in_two_namespaces_are_two_orbax_items(tmp_path):
    tree = {'p': {'a.b': np.zeros(3, np.float32)}, 'q': {'a': {'b': np.ones(3, np.float32)}}}
    jckpt.adapters.write(tree, tmp_path / 'o', format='orbax')
    back = jckpt.adapters.read(tmp_path / 'o')
    assert back['p']['a.b'].tolist() == [0, 0, 0] and back['q']['a']['b'].tolist() == [1, 1, 1]


def test_manager_step_with_several_items(tmp_path, orbax_tree):
    with ocp.CheckpointManager(tmp_path / 'run') as manager:
        manager.save(5, args=ocp.args.Composite(params=ocp.args.PyTreeSave(orbax_tree),
                                                extra=ocp.args.PyTreeSave({'s': np.int32(3)})))
        manager.wait_until_finished()
    step = tmp_path / 'run' / '5'
    tree = jckpt.adapters.read(step)
    assert set(tree) == {'params', 'extra'}
    assert_same(orbax_tree, tree['params'])
    with pytest.raises(FormatError, match=r'pass one step.s directory.*run/5'):
        jckpt.adapters.read(tmp_path / 'run')


# orbax leaves a callback on its closed event loop when tensorstore fails; that is not ours
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_damaged_orbax_checkpoint_is_refused(tmp_path, orbax_tree):
    item = tmp_path / 'item'
    ocp.PyTreeCheckpointer().save(item, orbax_tree)
    for root, _, files in os.walk(item / 'd'):
        for name in files:
            path = os.path.join(root, name)
            with open(path, 'r+b') as f:
                f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(FormatError, match='orbax could not read') as info:
        jckpt.adapters.read(item)
    assert str(item) in str(info.value)


def test_synchronous_manager_and_plain_checkpointer(tmp_path):
    tree = {'k': jax.random.key(3), 'x': jnp.arange(4)}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / 'sync', options=options) as manager:
        manager.save(0, args=ocp.args.Composite(state=orbax_handler.JckptSave(tree)))
        got = manager.restore(0, args=ocp.args.Composite(state=orbax_handler.JckptRestore(tree)))
    assert jnp.array_equal(jax.random.key_data(got['state']['k']), jax.random.key_data(tree['k']))
    with ocp.Checkpointer(orbax_handler.JckptCheckpointHandler()) as checkpointer:
        checkpointer.save(tmp_path / 'plain', args=orbax_handler.JckptSave(tree))
        again = checkpointer.restore(tmp_path / 'plain', args=orbax_handler.JckptRestore(tree))
    assert jnp.array_equal(again['x'], tree['x'])
    assert jckpt.describe(tmp_path / 'plain' / orbax_handler.FILENAME).tensors[0].key_impl is not None


# --- the handler given a directory in an object store ---------------------------------------

def handler_round_trip(directory):
    """Save synchronously and asynchronously through the handler into `directory` (an
    `epath.Path` of a URL, as orbax gives it), restore and describe from there."""
    from jckpt.storage import backend_for

    handler = orbax_handler.JckptCheckpointHandler()
    tree = {'params': {'w': np.arange(12, dtype=np.float32).reshape(3, 4),
                       'b': jnp.ones(3, jnp.bfloat16)}, 'step': np.int32(7)}
    handler.save(directory / 'sync', args=orbax_handler.JckptSave(tree))
    values = np.arange(6, dtype=np.float32)
    futures = orbax_handler._run(handler.async_save(directory / 'async',
                                                    args=orbax_handler.JckptSave({'v': values})))
    values[:] = -1  # snapshotted at async_save: the background commit writes the old values
    for f in futures:
        f.result()
    url = str(directory)
    assert backend_for(url).list(url) == ['async', 'sync']
    assert backend_for(url).exists(f"{url}/sync/{orbax_handler.FILENAME}")
    back = handler.restore(directory / 'sync', args=orbax_handler.JckptRestore(tree))
    np.testing.assert_array_equal(back['params']['w'], tree['params']['w'])
    assert back['params']['b'].dtype == jnp.bfloat16 and int(back['step']) == 7
    assert handler.restore(directory / 'async')['v'].tolist() == [0, 1, 2, 3, 4, 5]
    meta = handler.metadata(directory / 'sync')
    assert meta.tree['params']['w'].shape == (3, 4) and meta.tree['params']['b'].dtype == jnp.bfloat16
    again = handler.restore(directory / 'sync', args=orbax_handler.JckptRestore(meta.tree))
    np.testing.assert_array_equal(again['params']['w'], tree['params']['w'])


def test_the_handler_in_a_gs_directory():
    """orbax gives handlers an `epath.Path`; for a bucket its str is the gs:// URL, which
    jckpt stores through its object store backend (here obstore's memory store for the bucket)."""
    pytest.importorskip('obstore')
    from etils import epath
    from obstore.store import MemoryStore

    from jckpt.storage import object_store

    object_store.configure('gs://orbax-items', store=MemoryStore())
    try:
        handler_round_trip(epath.Path('gs://orbax-items/run/3/state'))
    finally:
        object_store.configure('gs://orbax-items')


def test_the_handler_in_an_s3_directory(s3):
    from etils import epath

    handler_round_trip(epath.Path(f'{s3}/run/3/state'))


@pytest.mark.parametrize("url", ["memory://ckpts/exp/orb", "s3://ckpts/exp/orb"])
def test_an_orbax_destination_in_a_bucket_is_refused_not_written_locally(tmp_path, monkeypatch, url):
    """convert(..., format='orbax') to s3:// reported success and wrote ./s3:/ckpts/... locally."""
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, src)
    with pytest.raises(jckpt.InputError, match="written to a local directory") as e:
        jckpt.convert(src, url, format="orbax")
    assert e.value.file == url and "upload" in e.value.fix
    assert sorted(os.listdir(tmp_path)) == ["m.jckpt"]


def test_an_export_replaces_an_orbax_checkpoint_but_never_a_folder_of_other_files(tmp_path):
    """convert(..., format='orbax') onto an existing directory deleted whatever it held: a
    user's folder, or a jckpt manager's whole run, replaced by one step."""
    src = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, src)
    (tmp_path / "mine" / "sub").mkdir(parents=True)
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with jckpt.CheckpointManager(tmp_path / "run", asynchronous=False) as mgr:
        mgr.save(1, {"w": np.ones(2)})
    for folder, held in (("mine", "notes.txt, sub"), ("run", "step_00000001.jckpt")):
        with pytest.raises(jckpt.InputError, match=f"exporting to orbax would replace a directory "
                                                    f"holding \\d entr.* no part of an orbax "
                                                    f"checkpoint \\({held}") as e:
            jckpt.convert(src, tmp_path / folder, format="orbax")
        assert "move what is there out" in e.value.fix
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    assert jckpt.CheckpointManager(tmp_path / "run", read_only=True).all_steps() == [1]
    (tmp_path / "file").write_text("precious")
    os.mkfifo(tmp_path / "fifo")
    for name, there in (("file", "a file that is not an orbax checkpoint"), ("fifo", "is a FIFO")):
        with pytest.raises(jckpt.InputError, match=there):
            jckpt.convert(src, tmp_path / name, format="orbax")
    assert (tmp_path / "file").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    for dst in ("exported", "exported", "exported/jckpt", "empty"):  # new, replaced, an item
        jckpt.convert(src, tmp_path / dst, format="orbax")
        assert jckpt.diff(src, tmp_path / dst).same


def test_item_metadata_keeps_nodes_without_leaves(tmp_path):
    """adamw's state is (ScaleByAdamState, EmptyState, EmptyState): the metadata's tree had one
    element instead of three."""
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones(3)}
    state = {"params": params, "opt": optax.adamw(1e-3).init(params)}
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, args=ocp.args.Composite(state=orbax_handler.JckptSave(state)))
        manager.wait_until_finished()
        tree = manager.item_metadata(1)["state"].tree
    assert len(tree["opt"]) == 3 and tree["opt"][1] is None and tree["opt"][2] is None
    assert tree["opt"][0]["mu"]["w"].shape == (3,)


def test_restore_without_a_target_has_the_structure_of_the_metadata(tmp_path):
    """orbax's own restore without a target, and the item's metadata, give adamw's state as
    three elements; the jckpt item's restore without a target gave one."""
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones(3)}
    state = {"params": params, "opt": optax.adamw(1e-3).init(params)}
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, args=ocp.args.Composite(state=orbax_handler.JckptSave(state),
                                                theirs=ocp.args.StandardSave(state)))
        manager.wait_until_finished()
        tree = manager.item_metadata(1)["state"].tree
        got = manager.restore(1, args=ocp.args.Composite(state=orbax_handler.JckptRestore(),
                                                         theirs=ocp.args.StandardRestore()))
    assert jax.tree_util.tree_structure(got["state"]) == jax.tree_util.tree_structure(tree)
    assert jax.tree_util.tree_structure(got["state"]) == jax.tree_util.tree_structure(got["theirs"])
    assert got["state"]["opt"][1:] == [None, None]
    np.testing.assert_array_equal(got["state"]["opt"][0]["nu"]["w"], np.zeros(3))


def test_reading_a_manager_step_holds_back_orbax_warnings(tmp_path, caplog):
    """`jckpt convert <orbax step>` printed "WARNING:absl:Metadata file does not exist"."""
    import logging
    with ocp.CheckpointManager(str(tmp_path / 'run')) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({'w': np.ones(3)})))
    with caplog.at_level(logging.WARNING):
        tree = jckpt.adapters.read(tmp_path / 'run' / '1')
    assert np.asarray(jax.tree.leaves(tree)[0]).tolist() == [1, 1, 1]
    assert not [r for r in caplog.records if r.name == 'absl'], caplog.text
    assert logging.getLogger('absl').level != logging.ERROR  # restored


def test_holding_back_orbax_warnings_is_this_threads_alone():
    """It set the absl logger's shared level: two readers at once could leave it at ERROR for
    good, and another thread's warnings were dropped meanwhile."""
    import logging
    import threading

    from jckpt.adapters import orbax as orbax_adapter
    absl = logging.getLogger('absl')
    level = absl.level
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((record.threadName, record.getMessage()))
    absl.addHandler(handler)
    try:
        inside, done = threading.Event(), threading.Event()

        def reader():
            with orbax_adapter._quiet():
                absl.warning("held back")
                inside.set()
                done.wait(10)
        t = threading.Thread(target=reader, name='reader')
        t.start()
        inside.wait(10)
        absl.warning("shown")  # another thread, while the reader is quiet
        done.set()
        t.join()
    finally:
        absl.removeHandler(handler)
    assert seen == [('MainThread', 'shown')] and absl.level == level
    assert not orbax_adapter._QUIET.threads


def test_an_export_keeps_a_namespace_of_empty_states(tmp_path):
    """optax.sgd without momentum holds only EmptyStates: its namespace has no entry, and the
    export left it out, where orbax's own save of the same tree keeps the item."""
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones(3)}
    tree = {"params": params, "opt": optax.sgd(0.1).init(params)}
    jckpt.adapters.write(tree, tmp_path / "sgd.jckpt", format="jckpt")
    jckpt.convert(tmp_path / "sgd.jckpt", tmp_path / "ours", format="orbax")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(tmp_path / "theirs", ocp.args.Composite(
            **{ns: ocp.args.PyTreeSave(sub) for ns, sub in tree.items()}))

    def restored(name):
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            return dict(checkpointer.restore(tmp_path / name, ocp.args.Composite(
                **{ns: ocp.args.PyTreeRestore() for ns in tree})))

    ours, theirs = restored("ours"), restored("theirs")
    assert sorted(ours) == sorted(theirs) == ["opt", "params"]
    assert ours["opt"] == theirs["opt"] == [None, None]
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)


def test_convert_of_a_step_walks_it_once(tmp_path, monkeypatch):
    """The step's files were walked and checked twice: once for the step, again for each item."""
    from jckpt.adapters import orbax as orbax_adapter

    step = tmp_path / 'step'
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(step, ocp.args.Composite(params=ocp.args.PyTreeSave({'w': np.ones(3)}),
                                                   meta=ocp.args.JsonSave({'epoch': 2})))
    walks = []
    real = orbax_adapter.check_tree
    monkeypatch.setattr(orbax_adapter, 'check_tree',
                        lambda path, *items: walks.append(path) or real(path, *items))
    jckpt.convert(step, tmp_path / 'out.jckpt')
    assert walks == [str(step)]
    assert json.loads(jckpt.describe(tmp_path / 'out.jckpt').metadata_dict()['jckpt.orbax_json']) == \
        {'meta': {'epoch': 2}}


def test_a_nan_in_an_orbax_json_item_is_kept_as_strict_json(tmp_path):
    """Orbax writes a NaN in a JSON item as the bare token `NaN`; convert copied it so into
    the jckpt header, which strict JSON parsers then refuse. It is kept tagged, as jckpt's
    own non-finite floats are (`jckpt.format.strict_json`), and reads back as NaN."""
    from jckpt.format import strict_json

    step = tmp_path / 'step'
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(step, ocp.args.Composite(params=ocp.args.PyTreeSave({'w': np.ones(3)}),
                                                   meta=ocp.args.JsonSave({'loss': float('nan')})))
    jckpt.convert(step, tmp_path / 'out.jckpt')
    text = jckpt.describe(tmp_path / 'out.jckpt').metadata_dict()['jckpt.orbax_json']
    json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} is not strict JSON"))
    assert np.isnan(strict_json.loads(text)['meta']['loss'])


@pytest.mark.parametrize('empty', ['EmptyState', None, (), {}])
def test_a_namespace_that_is_one_empty_node_is_kept_and_left_out_of_an_export(tmp_path, empty):
    """`optax.identity().init(params)` (a bare EmptyState) saved as a namespace had no path
    to record: `read` and `convert` lost the namespace. orbax saves no such item ("Found
    empty item"), so an export leaves it out, with a warning, and orbax restores the rest."""
    optax = pytest.importorskip("optax")
    state = optax.identity().init({'w': np.ones(3)}) if empty == 'EmptyState' else empty
    with pytest.raises(ValueError, match='empty item|Must provide item'):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / 'theirs', state)
    src = tmp_path / 'a.jckpt'
    jckpt.save(jckpt.Context(namespace='params'), {'w': np.ones(3)}, src)
    jckpt.save(jckpt.Context(namespace='opt'), state, src, appending=True)
    tree = jckpt.adapters.read(src)
    assert sorted(tree) == ['opt', 'params'] and tree['opt'] is None
    jckpt.convert(src, tmp_path / 'b.jckpt')
    assert jckpt.adapters.read(tmp_path / 'b.jckpt')['opt'] is None
    with pytest.warns(UserWarning, match=r"\['opt'\] hold no arrays"):
        jckpt.convert(src, tmp_path / 'ours', format='orbax')
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        back = checkpointer.restore(tmp_path / 'ours', ocp.args.Composite(
            params=ocp.args.PyTreeRestore()))
    assert list(back) == ['params'] and back['params']['w'].tolist() == [1, 1, 1]


def test_a_restore_written_with_standard_restore_reads_a_jckpt_item(tmp_path):
    """Code that restores with `ocp.args.StandardRestore` reads jckpt items once the manager's
    registry gives them to the handler; other args are refused naming the item's file."""
    tree = {'w': jnp.arange(4.0), 'step': jnp.int32(3)}
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.Composite(state=orbax_handler.JckptSave(tree)))
        manager.wait_until_finished()
    handler = orbax_handler.JckptCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (orbax_handler.JckptSave, orbax_handler.JckptRestore, ocp.args.StandardRestore,
                 ocp.args.PyTreeRestore):
        registry.add('state', args, handler)
    with ocp.CheckpointManager(tmp_path, handler_registry=registry) as manager:
        got = manager.restore(1, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.eval_shape(lambda: tree))))['state']
        with pytest.raises(jckpt.InputError, match='not PyTreeRestore') as e:
            manager.restore(1, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(tree)))
    assert e.value.file.endswith(orbax_handler.FILENAME) and 'JckptRestore' in e.value.fix
    assert np.array_equal(got['w'], tree['w']) and got['step'] == 3



def test_an_export_refuses_its_destination_before_reading_the_source(tmp_path, monkeypatch):
    """The destination was checked by the orbax writer, once the whole source was read: a
    wrong one failed after reading gigabytes, not at once."""
    import jckpt.adapters

    src = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, src)
    reads = []
    monkeypatch.setattr(jckpt.adapters, "_read_with_metadata",
                        lambda *a: reads.append(a) or pytest.fail("the source was read"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    (tmp_path / "file").write_text("precious")
    for dst, match in (("mine", "no part of an orbax checkpoint"),
                       ("file", "a file that is not an orbax checkpoint"),
                       ("s3://bucket/exported", "written to a local directory")):
        with pytest.raises(jckpt.InputError, match=match):
            jckpt.convert(src, dst if "://" in dst else tmp_path / dst, format="orbax")
    assert reads == [] and (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_an_export_never_replaces_an_orbax_step_holding_a_file_of_the_users(tmp_path, capsys):
    """An orbax step into which a user put a file of their own still counted as "one orbax
    checkpoint", and `convert --format orbax --overwrite` replaced it, deleting the file: the
    export now names it, in Python and on the command line, and replaces the step once the
    file is moved out."""
    from jckpt.tools.cli import main

    src = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, src)
    step = tmp_path / "step"
    jckpt.convert(src, step, format="orbax")
    (step / "notes.txt").write_text("precious")
    match = ("would replace a directory holding 1 entry that is no part of an orbax checkpoint "
             r"\(notes.txt\)")
    with pytest.raises(jckpt.InputError, match="exporting to orbax " + match):
        jckpt.convert(src, step, format="orbax")
    assert main(["convert", str(src), str(step), "--format", "orbax", "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (step / "notes.txt").read_text() == "precious"
    os.rename(step / "notes.txt", tmp_path / "notes.txt")
    jckpt.convert(src, step, format="orbax")  # orbax's own files alone: replaced
    assert "_CHECKPOINT_METADATA" in os.listdir(step)
