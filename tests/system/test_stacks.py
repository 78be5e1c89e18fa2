"""The stacks JAX users run (flax NNX and Linen, optax, equinox, orbax), driven as a user would.

Each test is one workflow, written the way the library's users write it:
build a state with the stack's own calls, checkpoint it through jckpt, and
get it back into what the stack's own "abstract state" call gives
(``jax.eval_shape``, ``nnx.eval_shape``). Stacks that are not installed skip
their tests.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jckpt
from jckpt import adapters
from jckpt.api.multiprocess import save_directory
from jckpt.errors import InputError, MismatchError, MissingEntryError
from tests.helpers import cpu_mesh

CTX = jckpt.Context()


def _orbax():
    return pytest.importorskip("orbax.checkpoint")


def _adamw_state():
    optax = pytest.importorskip("optax")
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = optax.adamw(1e-3)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)  # count 1, non-zero moments
    return state


def _same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- cast=True on scalars ------------------------------------------------------------------

@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_cast_converts_scalars(tmp_path, directory):
    path = tmp_path / "s.jckpt"
    tree = {"step": jnp.int32(7), "loss": jnp.float32(1.5)}
    if directory:  # read through the directory reader's lazy arrays
        save_directory(CTX, tree, path)
    else:
        jckpt.save(CTX, tree, path)
    back = jckpt.restore(CTX, {"step": jax.ShapeDtypeStruct((), jnp.float32),
                               "loss": jax.ShapeDtypeStruct((), jnp.bfloat16)}, path, cast=True)
    assert back["step"].dtype == jnp.float32 and float(back["step"]) == 7.0
    assert back["loss"].dtype == jnp.bfloat16 and float(back["loss"]) == 1.5
    host = jckpt.restore(CTX, {"step": np.float64(0)}, path, cast=True)
    assert host["step"].dtype == np.float64 and host["step"] == 7.0


def test_ml_dtypes_scalars_cast(tmp_path):
    jckpt.save(CTX, {"x": np.float32(2.5)}, tmp_path / "x.jckpt")
    back = jckpt.restore(CTX, {"x": np.zeros((), ml_dtypes.bfloat16)}, tmp_path / "x.jckpt", cast=True)
    assert back["x"].dtype == ml_dtypes.bfloat16 and float(back["x"]) == 2.5


# --- weakly typed targets: Python numbers -----------------------------------------------------

def test_flax_train_state_at_step_zero_restores_into_eval_shape(tmp_path):
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    def init():
        model = Model()
        params = model.init(jax.random.key(0), jnp.ones((1, 2)))
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-3))

    state = init()
    assert state.step == 0 and isinstance(state.step, int)  # a Python int: stored as int64
    jckpt.save(CTX, state, tmp_path / "ts.jckpt")
    abstract = jax.eval_shape(init)
    assert abstract.step.weak_type and abstract.step.dtype == jnp.int32
    back = jckpt.restore(CTX, abstract, tmp_path / "ts.jckpt")
    assert int(back.step) == 0 and back.step.dtype == jnp.int32
    _same(back.params, state.params)
    back = back.apply_gradients(grads=jax.tree_util.tree_map(jnp.zeros_like, back.params))
    assert int(back.step) == 1


def test_flax_train_state_restores_into_eval_shape_under_a_mesh_and_trains_there(tmp_path):
    """Under `jax.set_mesh`, `jax.eval_shape` gives the parameters shardings on the abstract
    mesh and the weakly typed `step` none: its restore failed with JAX's "incompatible
    devices" ValueError (the step, put on one device, made weak under the mesh)."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training import train_state

    net, tx = nn.Dense(8), optax.adam(1e-3)

    def create():
        params = net.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
        return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

    jckpt.save(CTX, create(), tmp_path / "ts.jckpt")
    mesh = cpu_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        back = jckpt.restore(CTX, jax.eval_shape(create), tmp_path / "ts.jckpt")
        assert back.step.weak_type and back.step.sharding == NamedSharding(mesh, P())
        assert back.params["kernel"].sharding.mesh == mesh
        step = jax.jit(lambda s: s.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like,
                                                                                 s.params)))
        assert int(step(back).step) == 1


def test_weak_target_takes_a_stored_value_only_when_it_fits(tmp_path):
    """Integers only when they fit exactly; floats rounded to the target's precision, as JAX
    rounds the Python number itself, but never overflowed."""
    path = tmp_path / "n.jckpt"
    jckpt.save(CTX, {"step": 3, "big": 2 ** 40, "half": 0.5, "tenth": 0.1, "flag": 1,
                     "huge": 1e300, "nan": float("nan"), "inf": float("-inf")}, path)
    weak = jax.eval_shape(lambda: {"step": 0, "big": 0, "half": 0.0, "tenth": 0.0, "flag": 0.0,
                                   "huge": 0.0, "nan": 0.0, "inf": 0.0})
    back = jckpt.restore(CTX, {k: weak[k] for k in ("step", "half", "tenth", "nan", "inf")}, path)
    assert back["step"].dtype == jnp.int32 and int(back["step"]) == 3
    assert back["half"].dtype == jnp.float32 and float(back["half"]) == 0.5
    assert back["tenth"].dtype == jnp.float32 and back["tenth"] == jnp.asarray(0.1)
    assert jnp.isnan(back["nan"]) and back["inf"] == -jnp.inf
    assert int(jckpt.restore(CTX, {"step": jnp.asarray(0)}, path)["step"]) == 3  # a weak array

    with pytest.raises(MismatchError, match=r"jckpt/big.*value 1099511627776 does not fit.*int32") as e:
        jckpt.restore(CTX, {"big": weak["big"]}, path)
    assert "cast=True" in e.value.fix and "int64" in e.value.fix
    with pytest.raises(MismatchError, match=r"jckpt/huge.*1e\+300 does not fit .* weakly typed float32"):
        jckpt.restore(CTX, {"huge": weak["huge"]}, path)  # never overflowed silently
    assert float(jckpt.restore(CTX, {"flag": weak["flag"]}, path)["flag"]) == 1.0  # as 0.0 takes it
    with pytest.raises(MismatchError, match=r"jckpt/half: dtype mismatch: file has float64"):
        jckpt.restore(CTX, {"half": weak["step"]}, path)  # a wider kind: never narrowed
    with pytest.raises(MismatchError, match="dtype mismatch"):  # a strongly typed target refuses
        jckpt.restore(CTX, {"step": jax.ShapeDtypeStruct((), jnp.int32)}, path)
    assert float(jckpt.restore(CTX, {"huge": weak["huge"]}, path, cast=True)["huge"]) == np.inf


# --- optax states through orbax: NamedTuple fields become dict keys --------------------------

def test_orbax_optax_state_converts_and_restores_into_its_structure(tmp_path):
    ocp = _orbax()
    state = _adamw_state()
    src = str(tmp_path / "orbax_state")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(src, state)
    jckpt.convert(src, tmp_path / "c.jckpt")
    stored = [e.path for e in jckpt.describe(tmp_path / "c.jckpt").tensors]
    assert (("i", 0), ("k", "count")) in stored  # orbax records the field as a dict key
    back = jckpt.restore(CTX, jax.eval_shape(lambda: state), tmp_path / "c.jckpt")
    _same(back, state)
    assert type(back[0]).__name__ == "ScaleByAdamState"


class _Adam(NamedTuple):
    count: jax.Array
    mu: list


def test_paths_differing_only_in_key_kinds_match(tmp_path):
    path = tmp_path / "kinds.jckpt"
    jckpt.save(CTX, {"count": np.int32(2), "mu": {0: np.ones(2, np.float32)}}, path)
    back = jckpt.restore(CTX, _Adam(jnp.int32(0), [jnp.zeros(2)]), path)  # attribute, index
    assert isinstance(back, _Adam) and int(back.count) == 2
    np.testing.assert_array_equal(back.mu[0], np.ones(2))


def test_missing_entry_never_lists_the_missing_name_as_present(tmp_path, monkeypatch):
    path = tmp_path / "m.jckpt"
    jckpt.save(CTX, {"opt/count": np.int32(1), "w": np.ones(2)}, path)
    with pytest.raises(MissingEntryError) as e:
        jckpt.restore(CTX, {"opt": {"count": jnp.int32(0)}}, path)
    assert "same name but another nesting" in str(e.value)
    assert "['opt']['count']" in str(e.value) and "['opt/count']" in str(e.value)
    with pytest.raises(MissingEntryError) as e:
        jckpt.restore(CTX, {"nope": jnp.int32(0)}, path)
    assert "jckpt/nope: not in the checkpoint" in str(e.value) and "'nope'" not in e.value.fix

    # entries that differ from the target only in key kinds, more than one: named, with kinds
    # (such a file no save writes now, as no load rebuilds it; an older jckpt's append did)
    from jckpt.api import saving
    monkeypatch.setattr(saving, "check_one_tree", lambda *a, **k: None)
    jckpt.save(CTX, {0: np.ones(1)}, tmp_path / "two.jckpt")
    jckpt.save(CTX, [np.zeros(1)], tmp_path / "two.jckpt", appending=True)
    monkeypatch.undo()

    class Box:
        def __init__(self, x):
            self.x = x

    jax.tree_util.register_pytree_node(Box, lambda b: ((b.x,), None), lambda _, c: Box(*c))
    with pytest.raises(MissingEntryError, match=r"ambiguous.*<flat index 0>.*\[0\], \[0\]"):
        jckpt.restore(CTX, Box(jnp.zeros(1)), tmp_path / "two.jckpt")


# --- jckpt -> orbax ---------------------------------------------------------------------------

def test_optax_state_exports_to_orbax_with_its_empty_states(tmp_path):
    ocp = _orbax()
    state = _adamw_state()
    abstract = jax.eval_shape(lambda: state)
    jckpt.save(CTX, state, tmp_path / "s.jckpt")
    restored = jckpt.restore(CTX, abstract, tmp_path / "s.jckpt")  # the tree, empty states and all
    adapters.write({"jckpt": restored}, tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", abstract)
    _same(back, state)


def test_a_saved_optax_file_exports_to_orbax_with_its_empty_states(tmp_path):
    ocp = _orbax()
    state = _adamw_state()
    abstract = jax.eval_shape(lambda: state)
    jckpt.save(CTX, state, tmp_path / "s.jckpt")  # records where the EmptyStates are
    jckpt.save(jckpt.Context(namespace="model"), {"w": jnp.ones(2)}, tmp_path / "s.jckpt",
               appending=True)
    jckpt.convert(tmp_path / "s.jckpt", tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", abstract)
    _same(back, state)
    jckpt.convert(tmp_path / "exported", tmp_path / "again.jckpt")  # and back: still recorded
    jckpt.convert(tmp_path / "again.jckpt", tmp_path / "twice", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        _same(checkpointer.restore(tmp_path / "twice" / "jckpt", abstract), state)


def test_masked_weight_decay_state_exports_to_orbax(tmp_path):
    """A chain that starts with masked weight decay: its first state holds no array at all
    (`MaskedState(inner_state=EmptyState())`), so the export must build that node too."""
    ocp = _orbax()
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    tx = optax.chain(optax.masked(optax.add_decayed_weights(1e-4), {"w": True, "b": False}),
                     optax.adam(1e-3))
    _, state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), tx.init(params), params)
    jckpt.save(CTX, state, tmp_path / "s.jckpt")
    jckpt.convert(tmp_path / "s.jckpt", tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", jax.eval_shape(tx.init, params))
    _same(back, state)
    assert type(back[0]).__name__ == "MaskedState"


def test_an_optimizer_state_without_arrays_resumes_as_saved(tmp_path):
    """Plain SGD keeps no arrays ((EmptyState(), EmptyState())): its namespace was saved and
    recorded, and the resume that asked for it was refused with "no namespace 'opt'"."""
    optax = pytest.importorskip("optax")
    params, tx = {"w": jnp.ones(3)}, optax.sgd(1e-2)
    abstract = {"params": jax.eval_shape(lambda: params), "opt": jax.eval_shape(tx.init, params)}
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, items={"params": params, "opt": tx.init(params)}, force=True)
        mgr.wait_durable()
        back = mgr.restore(target=abstract, namespaces=["params", "opt"]).tree
    assert type(back["opt"][0]).__name__ == "EmptyState"
    _same(back["params"], params)
    jckpt.save(jckpt.Context(namespace="params"), params, tmp_path / "s.jckpt")
    jckpt.save(jckpt.Context(namespace="opt"), tx.init(params), tmp_path / "s.jckpt", appending=True)
    back = jckpt.restore(CTX, abstract, tmp_path / "s.jckpt", namespaces=["params", "opt"])
    assert type(back["opt"][1]).__name__ == "EmptyState"
    with pytest.raises(MissingEntryError, match="no namespace 'model'"):  # one with leaves: refused
        jckpt.restore(CTX, {"model": abstract["params"], "opt": abstract["opt"]}, tmp_path / "s.jckpt",
                      namespaces=["model", "opt"])


def test_a_directory_checkpoint_records_its_empty_states_too(tmp_path):
    ocp = _orbax()
    state = _adamw_state()
    save_directory(CTX, {"w": jnp.ones(2)}, tmp_path / "d.jckpt")  # a directory checkpoint...
    jckpt.save(CTX, state, tmp_path / "d.jckpt")  # ...stays one, replaced by the optax state
    jckpt.convert(tmp_path / "d.jckpt", tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        _same(checkpointer.restore(tmp_path / "exported" / "jckpt", jax.eval_shape(lambda: state)),
              state)


def test_typed_prng_keys_cross_to_orbax_and_back(tmp_path):
    ocp = _orbax()
    tree = {"key": jax.random.key(3), "keys": jax.random.split(jax.random.key(1), 3),
            "rbg": jax.random.key(2, impl="rbg"), "w": jnp.ones(2)}
    abstract = jax.eval_shape(lambda: tree)
    jckpt.save(CTX, tree, tmp_path / "k.jckpt")
    jckpt.convert(tmp_path / "k.jckpt", tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", abstract)
        checkpointer.save(tmp_path / "from_orbax", tree)
    _same(_data(back), _data(tree))
    jckpt.convert(tmp_path / "from_orbax", tmp_path / "o.jckpt")
    again = jckpt.restore(CTX, abstract, tmp_path / "o.jckpt")
    assert jax.dtypes.issubdtype(again["rbg"].dtype, jax.dtypes.prng_key)
    _same(_data(again), _data(tree))


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _data(tree):
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


# --- abstract meshes --------------------------------------------------------------------------

def _abstract_target(mesh, spec):
    return {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                      sharding=NamedSharding(mesh.abstract_mesh, spec))}


def test_abstract_mesh_target_restores_onto_the_mesh_in_context(tmp_path):
    jckpt.save(CTX, {"w": jnp.arange(32.0).reshape(8, 4)}, tmp_path / "w.jckpt")
    mesh = cpu_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        back = jckpt.restore(CTX, _abstract_target(mesh, P("data", "model")), tmp_path / "w.jckpt")
    assert back["w"].sharding == NamedSharding(mesh, P("data", "model"))
    np.testing.assert_array_equal(back["w"], np.arange(32.0).reshape(8, 4))


def test_abstract_mesh_without_one_in_context_spans_every_default_device_or_is_refused(tmp_path):
    """No mesh in context: an abstract mesh the size of the default backend's device count is
    placed on `jax.make_mesh` of its axes (on whatever backend is the default); another size
    is refused."""
    jckpt.save(CTX, {"w": jnp.arange(32.0).reshape(8, 4)}, tmp_path / "w.jckpt")
    n = jax.device_count()  # default backend: what the restore places onto
    every = jax.sharding.AbstractMesh((n,), ("data",))
    spec = P("data") if 8 % n == 0 else P()
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(every, spec))}
    back = jckpt.restore(CTX, target, tmp_path / "w.jckpt")
    assert back["w"].sharding.mesh.shape == {"data": n} and len(back["w"].sharding.device_set) == n
    np.testing.assert_array_equal(back["w"], np.arange(32.0).reshape(8, 4))
    other = jax.sharding.AbstractMesh((n + 1,), ("x",))
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(other, P()))}
    with pytest.raises(InputError, match=rf"abstract mesh \('x': {n + 1}\)") as e:
        jckpt.restore(CTX, target, tmp_path / "w.jckpt")
    assert "jax.set_mesh" in e.value.fix


def test_nnx_model_sharded_under_set_mesh_restores_into_nnx_eval_shape(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.linear = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)

    mesh = cpu_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        jckpt.save(CTX, nnx.state(model), tmp_path / "m.jckpt")
        abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(1)))
        graph, state = nnx.split(abstract)
        back = jckpt.restore(CTX, state, tmp_path / "m.jckpt")
        restored = nnx.merge(graph, back)
    kernel = restored.linear.kernel[...]
    assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    np.testing.assert_array_equal(kernel, model.linear.kernel[...])


def test_nnx_optimizer_state_saved_by_orbax_restores_into_nnx_eval_shape(tmp_path):
    # flax's own guide saves nnx.state(optimizer) with orbax, which writes the State's
    # integer keys (a chain's 0, 1) as strings: they match the target's integers
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    ocp = _orbax()

    def create():
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = create()
    optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax_opt", nnx.state(optimizer))
    _, abstract = nnx.eval_shape(create)
    back = jckpt.restore(CTX, nnx.state(abstract), tmp_path / "orbax_opt")
    _same(back, nnx.state(optimizer))


def test_a_nested_state_dict_restores_into_the_pure_dict_of_an_nnx_list(tmp_path):
    # convert(nest=True) keeps indices as string keys ('0'); nnx.List's pure dict has 0
    nnx = pytest.importorskip("flax.nnx")
    adapters.write({"jckpt": {f"layers.{i}.{name}": np.full(shape, i, np.float32)
                              for i in range(2) for name, shape in (("kernel", (2, 2)), ("bias", (2,)))}},
                   tmp_path / "model.safetensors")
    jckpt.convert(tmp_path / "model.safetensors", tmp_path / "model.jckpt", nest=True)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])

    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    state = nnx.state(abstract)
    back = jckpt.restore(CTX, nnx.to_pure_dict(state), tmp_path / "model.jckpt")
    nnx.replace_by_pure_dict(state, back)
    model = nnx.merge(nnx.graphdef(abstract), state)
    np.testing.assert_array_equal(model.layers[1].kernel[...], np.ones((2, 2)))


def test_nnx_state_and_its_pure_dict_mixed_up_say_which_to_restore_into(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    def create():
        return nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    model, abstract = create(), nnx.eval_shape(create)
    jckpt.save(CTX, nnx.to_pure_dict(nnx.state(model)), tmp_path / "pure.jckpt")
    with pytest.raises(MissingEntryError, match=r"the file has a leaf at \['bias'\]") as e:
        jckpt.restore(CTX, nnx.state(abstract), tmp_path / "pure.jckpt")
    assert "nnx.to_pure_dict(state), then nnx.replace_by_pure_dict" in e.value.fix
    state = nnx.state(abstract)  # the fix, as given, works
    nnx.replace_by_pure_dict(state, jckpt.restore(CTX, nnx.to_pure_dict(state), tmp_path / "pure.jckpt"))
    np.testing.assert_array_equal(nnx.merge(nnx.graphdef(abstract), state).kernel[...], model.kernel[...])

    jckpt.save(CTX, nnx.state(model), tmp_path / "state.jckpt")
    with pytest.raises(MissingEntryError, match=r"the file holds a subtree there, \['bias'\]") as e:
        jckpt.restore(CTX, nnx.to_pure_dict(nnx.state(abstract)), tmp_path / "state.jckpt")
    assert "restore into nnx.state(abstract_model)" in e.value.fix


def test_linen_variables_saved_whole_restored_as_params_say_where_they_are(tmp_path):
    nn = pytest.importorskip("flax.linen")
    variables = nn.Dense(3).init(jax.random.key(0), jnp.ones((1, 2)))  # {"params": {...}}
    jckpt.save(CTX, variables, tmp_path / "v.jckpt")
    abstract_params = jax.eval_shape(lambda: variables["params"])
    with pytest.raises(MissingEntryError, match=r"the file has it as \['params'\]\['bias'\]"):
        jckpt.restore(CTX, abstract_params, tmp_path / "v.jckpt")
    back = jckpt.restore(CTX, {"params": abstract_params}, tmp_path / "v.jckpt")  # nested as saved
    _same(back["params"], variables["params"])


# --- metadata ---------------------------------------------------------------------------------

def test_save_refuses_metadata_that_is_not_strings(tmp_path):
    path = tmp_path / "m.jckpt"
    with pytest.raises(InputError, match=r"metadata key 'step' has the int value 3") as e:
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={"step": 3})
    assert "str(" in e.value.fix and not path.exists()
    with pytest.raises(InputError, match="metadata key 3"):
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={3: "x"})
    with pytest.raises(InputError, match="metadata must be a mapping"):
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata=[("step", "3")])
    jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={"note": "x", "step": "3"})
    assert jckpt.describe(path).metadata_dict()["step"] == "3"


# --- friction ---------------------------------------------------------------------------------

def test_restore_reads_an_orbax_directory_without_converting(tmp_path):
    ocp = _orbax()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax_state", {"w": jnp.ones(2)})
    back = jckpt.restore(CTX, {"w": jnp.zeros(2)}, tmp_path / "orbax_state")
    np.testing.assert_array_equal(back["w"], np.ones(2))


def test_old_style_prng_key_restores_into_a_typed_key_target(tmp_path):
    """Plain uint32 key data (an old-style PRNGKey, or keys through a format without key types)
    is wrapped as the target's keys when its shape is their data's; else refused, saying how."""
    old = jax.random.PRNGKey(5)  # uint32[2]
    jckpt.save(CTX, {"rng": old, "many": jax.random.split(old, 3)}, tmp_path / "k.jckpt")
    back = jckpt.restore(CTX, jax.eval_shape(lambda: {"rng": jax.random.key(0),
                                                      "many": jax.random.split(jax.random.key(0), 3)}),
                         tmp_path / "k.jckpt")
    assert str(jax.random.key_impl(back["rng"])) == "threefry2x32" and back["many"].shape == (3,)
    assert jax.random.randint(back["rng"], (), 0, 100) == jax.random.randint(old, (), 0, 100)
    with pytest.raises(MismatchError, match=r"plain uint32\[2\] data, not the key data") as e:
        jckpt.restore(CTX, {"rng": jax.random.key(0, impl="rbg")}, tmp_path / "k.jckpt")  # 4 words
    assert "wrap_key_data" in e.value.fix and "shape mismatch" not in str(e.value)
    raw = jckpt.restore(CTX, {"rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}, tmp_path / "k.jckpt")
    key = jax.random.wrap_key_data(raw["rng"])  # the fix, as given, works
    assert jax.random.randint(key, (), 0, 100) == jax.random.randint(old, (), 0, 100)
