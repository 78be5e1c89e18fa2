"""Training states as flax, optax, equinox and orbax users build them, checkpointed whole.

Each test builds the state with the stack's own calls after a few real
updates (batch statistics, dropout streams, optimizer counts, schedules) and
gets it back into the stack's own abstract state, bit for bit. Stacks that
are not installed skip their tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError
from tests.helpers import cpu_mesh

CTX = jckpt.Context()


def _same(a, b):
    """Same key paths and the same values (typed keys by their data)."""
    pa, pb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in pa] == [p for p, _ in pb]
    for (_, x), (_, y) in zip(pa, pb):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            sharded = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.hidden = nnx.Linear(8, 16, kernel_init=sharded, rngs=rngs)
            self.out = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(self.drop(self.bn(self.l1(x))))))

    return nnx, Model


def _MASK(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _transforms():
    optax = pytest.importorskip("optax")
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
    return {
        "adamw_schedule": lambda: optax.adamw(sched, weight_decay=0.1),
        "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2),
        "chain_masked_clip": lambda: optax.chain(
            optax.clip_by_global_norm(1.0), optax.masked(optax.add_decayed_weights(0.1), _MASK),
            optax.scale_by_adam(), optax.scale_by_schedule(sched), optax.scale(-1.0)),
        "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=sched),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw_schedule", "multisteps", "chain_masked_clip",
                                  "inject_hyperparams"])
def test_nnx_model_and_optimizer_resume_on_another_mesh(tmp_path, name):
    """BatchNorm statistics, dropout's typed key and count, the optimizer's step, and every
    optax state (MultiSteps' accumulators, masked and clip states, schedule counts) come
    back into `nnx.eval_shape`'s abstract states, placed on a mesh of another shape."""
    nnx, Model = _nnx_model()
    tx = _transforms()[name]

    def create():
        model = Model(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, tx(), wrt=nnx.Param)

    with jax.set_mesh(cpu_mesh((2, 4), ("data", "model"))):
        model, optimizer = create()
        x = jnp.ones((8, 4))
        for _ in range(2):  # MultiSteps applies its update at the second
            optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
        saved = {"model": nnx.state(model), "opt": nnx.state(optimizer)}
        jckpt.save(CTX, saved, tmp_path / "s.jckpt")
    other = cpu_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(other):
        abstract_model, abstract_opt = nnx.eval_shape(create)
        back = jckpt.restore(CTX, {"model": nnx.state(abstract_model),
                                   "opt": nnx.state(abstract_opt)}, tmp_path / "s.jckpt")
        resumed = nnx.merge(nnx.graphdef(abstract_model), back["model"])
    _same(back, saved)
    assert resumed.hidden.kernel[...].sharding.mesh.shape == {"data": 4, "model": 2}
    assert int(back["opt"]["step"][...]) == 2
    np.testing.assert_array_equal(jax.random.key_data(resumed.drop.rngs.key[...]),
                                  jax.random.key_data(model.drop.rngs.key[...]))


def test_nnx_rngs_and_split_filters_restore_their_streams(tmp_path):
    nnx, Model = _nnx_model()
    rngs = nnx.Rngs(0, params=1)
    rngs.params(), rngs.default(), rngs.default()  # counts 1 and 2
    with jax.set_mesh(cpu_mesh((2, 4), ("data", "model"))):
        model = Model(nnx.Rngs(0, dropout=1))
        graph, p, r = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(3, dropout=4))), nnx.Param, ...)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    jckpt.save(CTX, {"rngs": nnx.state(rngs), "params": params, "rest": rest}, tmp_path / "r.jckpt")
    abstract_rngs = nnx.eval_shape(lambda: nnx.Rngs(0, params=1))
    back = jckpt.restore(CTX, {"rngs": nnx.state(abstract_rngs), "params": p, "rest": r},
                         tmp_path / "r.jckpt")
    resumed = nnx.merge(nnx.graphdef(abstract_rngs), back["rngs"])
    np.testing.assert_array_equal(jax.random.key_data(resumed.default()),
                                  jax.random.key_data(rngs.default()))
    _same(nnx.state(nnx.merge(graph, back["params"], back["rest"])), nnx.state(model))


@pytest.mark.slow
def test_nnx_named_shardings_and_live_models_take_the_state_onto_another_mesh(tmp_path):
    """The targets flax's guides build for another mesh: `nnx.get_named_sharding` of the
    abstract state, `nnx.get_abstract_model`, and a live model made on that mesh."""
    nnx, Model = _nnx_model()
    with jax.set_mesh(cpu_mesh((2, 4), ("data", "model"))):
        model = Model(nnx.Rngs(0, dropout=1))
        graph, abstract = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1))))
    jckpt.save(CTX, nnx.state(model), tmp_path / "m.jckpt")
    other = cpu_mesh((4, 2), ("data", "model"))
    shardings = nnx.get_named_sharding(abstract, other)
    targets = {"named": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                     abstract, shardings)}
    if hasattr(nnx, "get_abstract_model"):
        targets["abstract_model"] = nnx.get_abstract_model(lambda: Model(nnx.Rngs(0, dropout=1)), other)[1]
    with jax.set_mesh(other):
        live = Model(nnx.Rngs(5, dropout=6))
    targets["live"] = nnx.state(live)
    for name, target in targets.items():
        back = jckpt.restore(CTX, target, tmp_path / "m.jckpt")
        kernel = nnx.merge(graph, back).hidden.kernel[...]
        assert kernel.sharding.mesh.shape == {"data": 4, "model": 2}, name
        _same(back, nnx.state(model))


def _linen_state():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.core import FrozenDict, freeze
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            return nn.Dense(1)(nn.Dropout(0.2, deterministic=not train)(x))

    class TrainState(train_state.TrainState):
        batch_stats: FrozenDict
        key: jax.Array

    def create():
        net = Net()
        variables = freeze(net.init(jax.random.key(0), jnp.ones((2, 4)), train=False))
        return TrainState.create(
            apply_fn=net.apply, params=variables["params"], batch_stats=variables["batch_stats"],
            key=jax.random.key(1), tx=optax.chain(optax.clip_by_global_norm(1.0),
                                                  optax.adamw(optax.cosine_decay_schedule(1e-3, 9))))

    @jax.jit
    def step(state):
        def loss(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, jnp.ones((2, 4)),
                mutable=["batch_stats"], rngs={"dropout": state.key})
            return jnp.mean(out ** 2), updates
        grads, updates = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    return TrainState, create, step


@pytest.mark.slow
def test_linen_train_state_with_batch_stats_and_frozen_dicts(tmp_path):
    TrainState, create, step = _linen_state()
    state = step(step(create()))
    jckpt.save(CTX, state, tmp_path / "t.jckpt")
    back = jckpt.restore(CTX, jax.eval_shape(create), tmp_path / "t.jckpt")
    assert isinstance(back, TrainState) and int(back.step) == 2
    assert type(back.batch_stats).__name__ == "FrozenDict"
    _same(back, state)
    step(back)  # trains on


def test_flax_struct_dataclass_state(tmp_path):
    struct = pytest.importorskip("flax.struct")
    optax = pytest.importorskip("optax")

    @struct.dataclass
    class State:
        params: dict
        opt: optax.OptState
        step: int
        rng: jax.Array
        name: str = struct.field(pytree_node=False, default="run")

    tx = optax.adamw(1e-3)

    def create():
        params = {"w": jnp.ones((3, 3))}
        return State(params=params, opt=tx.init(params), step=0, rng=jax.random.key(0))

    state = create().replace(step=5)
    jckpt.save(CTX, state, tmp_path / "d.jckpt")
    back = jckpt.restore(CTX, jax.eval_shape(create), tmp_path / "d.jckpt")
    assert isinstance(back, State) and int(back.step) == 5 and back.name == "run"
    _same(back, state)


def _eqx_model():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.linear = eqx.nn.Linear(4, 8, key=k1)
            self.norm = eqx.nn.BatchNorm(8, axis_name="batch")
            self.mlp = eqx.nn.MLP(8, 2, 8, 2, key=k2)

    return eqx, lambda key: eqx.nn.make_with_state(Model)(key)


def test_equinox_module_and_its_state_restore_through_partition(tmp_path):
    eqx, create = _eqx_model()
    model, state = create(jax.random.key(0))
    jckpt.save(CTX, {"model": eqx.filter(model, eqx.is_array), "state": state}, tmp_path / "e.jckpt")
    abstract, abstract_state = eqx.filter_eval_shape(create, jax.random.key(1))
    arrays, rest = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    back = jckpt.restore(CTX, {"model": arrays, "state": abstract_state}, tmp_path / "e.jckpt")
    _same(eqx.filter(eqx.combine(back["model"], rest), eqx.is_array), eqx.filter(model, eqx.is_array))
    _same(back["state"], state)


def test_equinox_module_restored_whole_names_the_leaf_no_file_stores(tmp_path):
    """An abstract module's functions and strings are leaves: restoring into it whole says
    which leaf is not an array and how to split the module, not that the file lacks it."""
    eqx, create = _eqx_model()
    model, _ = create(jax.random.key(0))
    jckpt.save(CTX, eqx.filter(model, eqx.is_array), tmp_path / "e.jckpt")
    abstract, _ = eqx.filter_eval_shape(create, jax.random.key(1))
    with pytest.raises(InputError, match=r"target leaf of type str \('batch'\) is not an array") as e:
        jckpt.restore(CTX, abstract, tmp_path / "e.jckpt")
    assert e.value.entry == "jckpt/norm/axis_name" and "eqx.partition" in e.value.fix


# --- orbax, as its 0.12 users write it ---------------------------------------------------------

def _nnx_train_state():
    """An NNX model (batch statistics, a dropout stream) and its optimizer after one update."""
    nnx, Model = _nnx_model()
    optax = pytest.importorskip("optax")

    def create():
        model = Model(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    with jax.set_mesh(cpu_mesh((2, 4), ("data", "model"))):
        model, optimizer = create()
        optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    return nnx, create, model, optimizer


def test_orbax_manager_with_jckpt_items_beside_json_restores_nnx_on_another_mesh(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    from jckpt.adapters.orbax_handler import JckptRestore, JckptSave
    nnx, create, model, optimizer = _nnx_train_state()
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        for step in range(3):
            manager.save(step, args=ocp.args.Composite(
                model=JckptSave(nnx.state(model)), opt=JckptSave(nnx.state(optimizer)),
                meta=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
    with jax.set_mesh(cpu_mesh((4, 2), ("data", "model"))):
        abstract_model, abstract_opt = nnx.eval_shape(create)
        with ocp.CheckpointManager(tmp_path / "run") as manager:
            got = manager.restore(manager.latest_step(), args=ocp.args.Composite(
                model=JckptRestore(nnx.state(abstract_model)), opt=JckptRestore(nnx.state(abstract_opt)),
                meta=ocp.args.JsonRestore()))
    assert manager.all_steps() == [1, 2] and got["meta"] == {"step": 2}
    assert got["model"]["hidden"]["kernel"][...].sharding.mesh.shape == {"data": 4, "model": 2}
    _same({"model": got["model"], "opt": got["opt"]},
          {"model": nnx.state(model), "opt": nnx.state(optimizer)})


@pytest.mark.slow
def test_jckpt_reads_orbax_own_checkpoints_of_nnx_and_linen_states(tmp_path):
    """An orbax manager's step of StandardSave items (nnx states, their typed keys) and a
    StandardCheckpointer's Linen TrainState restore into the stacks' abstract states."""
    ocp = pytest.importorskip("orbax.checkpoint")
    nnx, create, model, optimizer = _nnx_train_state()
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(5, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.state(model)),
                                                opt=ocp.args.StandardSave(nnx.state(optimizer))))
        manager.wait_until_finished()
    with jax.set_mesh(cpu_mesh((2, 4), ("data", "model"))):
        abstract_model, abstract_opt = nnx.eval_shape(create)
        back = jckpt.restore(CTX, {"model": nnx.state(abstract_model), "opt": nnx.state(abstract_opt)},
                             tmp_path / "run" / "5", namespaces=["model", "opt"])
    _same(back, {"model": nnx.state(model), "opt": nnx.state(optimizer)})

    TrainState, create_linen, step = _linen_state()
    state = step(create_linen())
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "linen", state)
    back = jckpt.restore(CTX, jax.eval_shape(create_linen), tmp_path / "linen")
    assert isinstance(back, TrainState) and int(back.step) == 1
    _same(back, state)


@pytest.mark.slow
def test_equinox_arrays_cross_to_orbax_and_back(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    eqx = pytest.importorskip("equinox")

    def make(key):
        return eqx.nn.MLP(4, 2, width_size=8, depth=2, key=key)

    model = make(jax.random.key(0))
    arrays, rest = eqx.partition(eqx.filter_eval_shape(make, jax.random.key(1)),
                                 lambda x: isinstance(x, jax.ShapeDtypeStruct))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", eqx.filter(model, eqx.is_array))
        jckpt.save(CTX, eqx.filter(model, eqx.is_array), tmp_path / "m.jckpt")
        jckpt.convert(tmp_path / "m.jckpt", tmp_path / "exported", format="orbax")
        from_jckpt = checkpointer.restore(tmp_path / "exported" / "jckpt", arrays)
    from_orbax = jckpt.restore(CTX, arrays, tmp_path / "orbax")
    for back in (from_orbax, from_jckpt):
        np.testing.assert_array_equal(eqx.combine(back, rest)(jnp.ones(4)), model(jnp.ones(4)))
