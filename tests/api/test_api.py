"""save / load / restore behaviour through the public API."""

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jckpt
from jckpt.errors import ChecksumError, InputError, MismatchError


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    params: dict
    step: jax.Array


def test_restore_exact_structures(tmp_path):
    path = tmp_path / "s.jckpt"
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    opt = optax.adam(1e-3).init(params)
    tree = {"state": State(params, jnp.int32(5)), "pair": Pair(jnp.ones(2), jnp.zeros(2)),
            "opt": opt, "tup": (jnp.ones(1), [jnp.zeros(1)])}
    jckpt.save(jckpt.Context(), tree, path)
    zeros = jax.tree.map(jnp.zeros_like, tree)
    back = jckpt.restore(jckpt.Context(), zeros, path)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert type(back["state"]) is State and type(back["pair"]) is Pair
    assert type(back["opt"][0]) is type(opt[0])
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert isinstance(x, jax.Array)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_from_shape_dtype_structs_and_partial_target(tmp_path):
    path = tmp_path / "s.jckpt"
    tree = {"params": {"w": jnp.ones((4, 4))}, "opt": {"mu": jnp.zeros((4, 4))}}
    jckpt.save(jckpt.Context(), tree, path)
    abstract = {"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}}
    back = jckpt.restore(jckpt.Context(), abstract, path)
    assert set(back) == {"params"} and float(back["params"]["w"].sum()) == 16


def test_empty_target_does_not_open_the_file(tmp_path):
    assert jckpt.restore(jckpt.Context(), {}, tmp_path / "missing.jckpt") == {}
    assert jckpt.restore(jckpt.Context(), {"a": {}, "b": []}, tmp_path / "x") == {"a": {},
                                                                                 "b": []}


def test_dtype_mismatch_and_cast(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.arange(4, dtype=np.float32)}, path)
    with pytest.raises(MismatchError, match="dtype mismatch.*cast=True"):
        jckpt.restore(jckpt.Context(), {"w": np.zeros(4, ml_dtypes.bfloat16)}, path)
    back = jckpt.restore(jckpt.Context(), {"w": jnp.zeros(4, jnp.bfloat16)}, path, cast=True)
    assert back["w"].dtype == jnp.bfloat16 and back["w"].tolist() == [0, 1, 2, 3]


def test_namespaces(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(namespace="teacher"), {"w": np.ones(2)}, path)
    jckpt.save(jckpt.Context(namespace="student"), {"w": np.zeros(2)}, path, appending=True)
    t = jckpt.restore(jckpt.Context(namespace="teacher"), {"w": np.zeros(2)}, path)
    s = jckpt.restore(jckpt.Context(), {"w": np.zeros(2)}, path, namespace="student")
    assert t["w"].tolist() == [1, 1] and s["w"].tolist() == [0, 0]
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert set(tree) == {"teacher", "student"}


def test_prefix_namespace_is_pure(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, path)
    header = jckpt.describe(path)
    pre = jckpt.prefix_namespace(header, "m1")
    assert [e.namespace for e in pre.tensors] == ["m1__jckpt"]
    assert [e.id for e in pre.tensors] == [e.id for e in header.tensors]
    assert header.tensors[0].namespace == "jckpt"
    assert jckpt.prefix_namespace(header, None) is header
    assert jckpt.prefix_namespace(header, "") is header
    assert jckpt.prefix_namespace({"a": 1}, "p") == {"p__a": 1}
    with pytest.raises(InputError, match="invalid namespace prefix"):
        jckpt.prefix_namespace(header, "1bad")
    with pytest.raises(InputError):
        jckpt.load(jckpt.Context(), path, prefix_namespace="no-dash")


def test_ids_start_above_loaded_registry(tmp_path):
    a, b = tmp_path / "a.jckpt", tmp_path / "b.jckpt"
    jckpt.save(jckpt.Context(), {"x": np.ones(1), "y": np.ones(1)}, a)
    ctx, _ = jckpt.load(jckpt.Context(host=True), a)
    jckpt.save(ctx, {"z": np.ones(1)}, b)
    assert [e.id for e in jckpt.describe(b).tensors] == [2]


def test_typed_prng_keys(tmp_path):
    path = tmp_path / "k.jckpt"
    keys = {"one": jax.random.key(3), "many": jax.random.split(jax.random.key(4), 5),
            "rbg": jax.random.key(5, impl="rbg")}
    jckpt.save(jckpt.Context(), keys, path)
    back = jckpt.restore(jckpt.Context(), keys, path)
    for name in keys:
        assert jax.random.key_impl(back[name]) == jax.random.key_impl(keys[name])
        np.testing.assert_array_equal(jax.random.key_data(back[name]),
                                      jax.random.key_data(keys[name]))
    _, tree = jckpt.load(jckpt.Context(), path)
    assert jax.dtypes.issubdtype(tree["jckpt"]["many"].dtype, jax.dtypes.prng_key)
    assert tree["jckpt"]["many"].shape == (5,)


def test_typed_keys_come_back_as_the_target_asks_or_are_refused(tmp_path):
    """A plain target takes the raw key data; a typed-key target of another implementation
    is refused, never handed keys of the stored one."""
    path = tmp_path / "k.jckpt"
    keys = {"fry": jax.random.split(jax.random.key(4), 3), "rbg": jax.random.key(5, impl="rbg")}
    jckpt.save(jckpt.Context(), keys, path)
    data = {k: np.asarray(jax.random.key_data(v)) for k, v in keys.items()}
    raw = jckpt.restore(jckpt.Context(), {"fry": jax.ShapeDtypeStruct((3, 2), jnp.uint32),
                                          "rbg": np.zeros((4,), np.uint32)}, path)
    assert raw["fry"].dtype == jnp.uint32 and isinstance(raw["rbg"], np.ndarray)
    assert {k: np.asarray(v).tolist() for k, v in raw.items()} == {k: v.tolist() for k, v in data.items()}
    abstract = jax.eval_shape(lambda: {"fry": jax.random.split(jax.random.key(0), 3),
                                       "rbg": jax.random.key(0, impl="rbg")})
    typed = jckpt.restore(jckpt.Context(), abstract, path)
    assert str(jax.random.key_impl(typed["rbg"])) == "rbg"
    with pytest.raises(jckpt.MismatchError, match="file has rbg keys, target has threefry2x32") as e:
        jckpt.restore(jckpt.Context(), {"rbg": jax.random.key(0)}, path)
    assert "impl='rbg'" in e.value.fix and e.value.entry == "jckpt/rbg"
    with pytest.raises(jckpt.MismatchError, match="holds typed PRNG keys"):  # the data has a trailing dim
        jckpt.restore(jckpt.Context(), {"fry": jax.ShapeDtypeStruct((3,), jnp.uint32)}, path)


def test_save_refuses_bad_leaf_before_touching_file(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(InputError, match="jckpt/bad.*not an array"):
        jckpt.save(jckpt.Context(), {"w": np.zeros(2), "bad": "text"}, path)
    with pytest.raises(InputError, match="cannot be stored"):
        jckpt.save(jckpt.Context(), {"w": np.array(["a"])}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.jckpt"]


def test_a_target_jax_cannot_flatten_names_the_file_as_saving_it_does(tmp_path):
    """`save` of `{1: x, '1': y}` named its file; `restore` into it named none."""
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, path)
    for call in (lambda t: jckpt.save(jckpt.Context(), t, path),
                 lambda t: jckpt.restore(jckpt.Context(), t, path),
                 lambda t: jckpt.restore(jckpt.Context(), {"jckpt": t}, path, namespaces="jckpt")):
        with pytest.raises(InputError, match="JAX cannot flatten the tree") as e:
            call({1: np.ones(1), "1": np.ones(1)})
        assert e.value.file == str(path)


def test_host_context_returns_mapped_numpy(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.arange(1000, dtype=np.float32)}, path)
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    w = tree["jckpt"]["w"]
    assert isinstance(w, np.ndarray) and not w.flags.owndata
    _, tree = jckpt.load(jckpt.Context(), path)
    assert isinstance(tree["jckpt"]["w"], jax.Array)


def test_x64_entries_stay_numpy_with_a_warning(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"d": np.arange(3, dtype=np.float64)}, path)
    if jax.config.jax_enable_x64:
        pytest.skip("x64 enabled")
    import jckpt.trees.placement as placement
    placement._warned_x64 = False
    with pytest.warns(UserWarning, match="jax_enable_x64"):
        _, tree = jckpt.load(jckpt.Context(), path)
    assert isinstance(tree["jckpt"]["d"], np.ndarray) and tree["jckpt"]["d"].dtype == np.float64


def test_checksums_catch_a_flipped_bit(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.arange(100, dtype=np.float32)}, path)
    e = jckpt.describe(path).tensors[0]
    raw = bytearray(path.read_bytes())
    start = len(raw) - e.byte_length
    raw[start + 37] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="jckpt/w.*checksum mismatch"):
        jckpt.load(jckpt.Context(), path, mmap=False)
    with pytest.raises(ChecksumError):
        jckpt.load(jckpt.Context(), path, verify=True)
    jckpt.load(jckpt.Context(), path)  # a mapped load does not read the payload


def test_metadata_and_appending_keeps_it(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(1)}, path, metadata={"step": "10", "run": "a"})
    jckpt.save(jckpt.Context(), {"v": np.ones(1)}, path, appending=True, metadata={"step": "11"})
    h = jckpt.describe(path)
    assert h.metadata_dict() == {"step": "11", "run": "a"}
    assert h.writer.startswith("jckpt ")


@pytest.mark.parametrize("key", ["jckpt.lineage", "jckpt.generation", "jckpt.step", "jckpt.x"])
def test_save_refuses_reserved_metadata_keys_before_writing(tmp_path, key):
    """A file saved by hand must not claim a mirror's lineage and generation, or a manager's
    step: a mirror opening it would take it for its own."""
    path = tmp_path / "md.jckpt"
    with pytest.raises(jckpt.InputError, match=f"metadata key '{key}' is reserved") as e:
        jckpt.save(jckpt.Context(), {"w": np.ones(1)}, path, metadata={key: "7"})
    assert not path.exists() and "jckpt." in e.value.fix


def test_appending_relays_at_new_alignment(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(alignment=1), {"a": np.arange(3, dtype=np.uint8),
                                            "b": np.arange(4, dtype=np.float32)}, path)
    jckpt.save(jckpt.Context(), {"c": np.ones(2)}, path, appending=True, alignment=64)
    h = jckpt.describe(path)
    assert h.alignment == 64 and all(e.offset % 64 == 0 for e in h.tensors)
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert tree["jckpt"]["b"].tolist() == [0, 1, 2, 3]


def test_not_durable_still_atomic(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(durable=False), {"w": np.ones(3)}, path)
    assert jckpt.restore(jckpt.Context(), {"w": np.zeros(3)}, path)["w"].sum() == 3


def test_context_is_frozen_and_validated():
    ctx = jckpt.Context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.namespace = "x"  # type: ignore[misc]
    with pytest.raises(InputError):
        jckpt.Context(namespace="bad-name")
    with pytest.raises(InputError):
        jckpt.Context(alignment=0)
    assert "namespace='jckpt'" in repr(ctx)


def test_python_scalars_restore_as_python_scalars(tmp_path):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"step": 12, "lr": 0.5, "flag": True}, path)
    back = jckpt.restore(jckpt.Context(), {"step": 0, "lr": 0.0, "flag": False}, path)
    assert back == {"step": 12, "lr": 0.5, "flag": True}


# --- namespaces= for load and restore ---------------------------------------------------

def two_namespaces(tmp_path):
    path = tmp_path / "ns.jckpt"
    jckpt.save(jckpt.Context(namespace="model"), {"w": np.arange(4.0), "b": np.ones(2)}, path)
    jckpt.save(jckpt.Context(namespace="opt"), {"mu": np.zeros(4), "count": np.int32(3)}, path,
               appending=True)
    jckpt.save(jckpt.Context(namespace="ema"), {"w": np.full(4, 2.0)}, path, appending=True)
    return path


def test_load_reads_only_the_namespaces_asked_for(tmp_path):
    path = two_namespaces(tmp_path)
    ctx, tree = jckpt.load(jckpt.Context(host=True), path, namespaces="model")
    assert list(tree) == ["model"] and tree["model"]["w"].tolist() == [0, 1, 2, 3]
    assert {ns for ns, _ in ctx.registry.identities} == {"model"}
    # the others can still be loaded into the same context: nothing else was registered
    ctx, rest = jckpt.load(ctx, path, namespaces=["opt", "ema"])
    assert set(rest) == {"opt", "ema"} and int(rest["opt"]["count"]) == 3
    _, pre = jckpt.load(jckpt.Context(host=True), path, namespaces=("ema",), prefix_namespace="s")
    assert list(pre) == ["s__ema"]
    _, none = jckpt.load(jckpt.Context(host=True), path, namespaces=[])
    assert none == {}


def test_load_names_a_missing_namespace_and_the_ones_present(tmp_path):
    path = two_namespaces(tmp_path)
    with pytest.raises(jckpt.MissingEntryError, match="no namespace 'optimizer'") as info:
        jckpt.load(jckpt.Context(), path, namespaces=["model", "optimizer"])
    assert info.value.file == str(path) and "['ema', 'model', 'opt']" in info.value.fix
    with pytest.raises(InputError, match="namespaces must be"):
        jckpt.load(jckpt.Context(), path, namespaces=[1])


def test_restore_several_namespaces_in_one_placement(tmp_path, monkeypatch):
    from jckpt.trees import placement

    path = two_namespaces(tmp_path)
    calls = []
    real = placement.place_all

    def counting(requests, **kw):
        calls.append([where for _, _, where, _ in requests])
        return real(requests, **kw)

    monkeypatch.setattr(placement, "place_all", counting)
    target = {"model": {"w": jax.ShapeDtypeStruct((4,), jnp.float64)},
              "opt": {"mu": np.zeros(4), "count": np.int32(0)}}
    back = jckpt.restore(jckpt.Context(host=True), target, path, namespaces=["model", "opt"])
    assert calls == [["model/w", "opt/count", "opt/mu"]]  # every leaf of both in one call
    assert set(back) == {"model", "opt"} and back["model"]["w"].tolist() == [0, 1, 2, 3]
    assert back["opt"]["mu"].tolist() == [0, 0, 0, 0] and int(back["opt"]["count"]) == 3
    one = jckpt.restore(jckpt.Context(), {"ema": {"w": jnp.zeros(4)}}, path, namespaces="ema",
                        cast=True)
    assert one["ema"]["w"].tolist() == [2, 2, 2, 2] and isinstance(one["ema"]["w"], jax.Array)


def test_a_target_keyed_by_the_files_namespaces_is_told_to_pass_namespaces(tmp_path):
    """A target of {namespace: subtree} (what a manager's items= saved) without namespaces=
    was told only to pass namespace=... or namespaces=[...] in general."""
    path = two_namespaces(tmp_path)
    target = {"model": {"w": np.zeros(4)}, "opt": {"mu": np.zeros(4)}}
    with pytest.raises(jckpt.MissingEntryError, match="it has no namespace 'jckpt'") as e:
        jckpt.restore(jckpt.Context(), target, path)
    assert "the target's key 'model' is a namespace of the file" in e.value.fix
    assert "namespaces=[...]" in e.value.fix


def test_restore_with_namespaces_keeps_each_subtree_type(tmp_path):
    path = tmp_path / "p.jckpt"
    jckpt.save(jckpt.Context(namespace="a"), Pair(np.ones(2), np.zeros(2)), path)
    jckpt.save(jckpt.Context(namespace="s"), State({"w": np.ones(3)}, np.int32(4)), path,
               appending=True)
    target = {"a": Pair(np.zeros(2), np.ones(2)), "s": State({"w": np.zeros(3)}, np.int32(0))}
    back = jckpt.restore(jckpt.Context(host=True), target, path, namespaces=["s", "a"])
    assert list(back) == ["s", "a"]
    assert type(back["a"]) is Pair and back["a"].a.tolist() == [1, 1]
    assert type(back["s"]) is State and int(back["s"].step) == 4


def test_a_missing_namespace_and_missing_leaves_are_all_named(tmp_path):
    """A target for the default namespace of a file without it was told only "the file has no
    entries in namespace 'jckpt'"; a model with new layers was told of its first new leaf."""
    path = two_namespaces(tmp_path)
    with pytest.raises(jckpt.MissingEntryError, match="it has no namespace 'jckpt'") as e:
        jckpt.restore(jckpt.Context(), {"w": np.zeros(4)}, path)
    assert "['ema', 'model', 'opt']" in e.value.fix and "namespace=" in e.value.fix
    target = {"w": np.zeros(4), **{f"new{i}": {"b": np.zeros(1)} for i in range(8)}}
    with pytest.raises(jckpt.MissingEntryError) as e:
        jckpt.restore(jckpt.Context(namespace="model"), target, path)
    assert e.value.entry == "model/new0/b"
    assert ("nothing under the target's ['new0'] (1 leaf), ['new1'] (1 leaf), ['new2'] (1 leaf), "
            "['new3'] (1 leaf), ['new4'] (1 leaf), ['new5'] (1 leaf), ...") in e.value.message
    assert "restore a target without them (e.g. restore only its ['w'])" in e.value.fix
    with pytest.raises(jckpt.MissingEntryError, match=r"1 other target leaf is missing too: model/x \(fix"):
        jckpt.restore(jckpt.Context(namespace="model"), {"w": np.zeros(4), "v": 0, "x": 0}, path)


def test_a_target_nested_otherwise_than_the_file_is_told_where_the_file_has_it(tmp_path):
    """A tree saved whole and restored in part, or the other way round: no target leaf
    matches, and the error says what the file holds at the first one's place."""
    path = tmp_path / "vars.jckpt"
    jckpt.save(jckpt.Context(), {"params": {"dense": {"w": np.ones(2)}}}, path)
    with pytest.raises(jckpt.MissingEntryError, match=r"jckpt/dense/w: not in the checkpoint: the "
                       r"file has it as \['params'\]\['dense'\]\['w'\], under \['params'\]") as e:
        jckpt.restore(jckpt.Context(), {"dense": {"w": np.zeros(2)}}, path)
    assert "under ['params']" in e.value.fix
    with pytest.raises(jckpt.MissingEntryError, match=r"without the target's \['state'\]") as e:
        jckpt.restore(jckpt.Context(), {"state": {"params": {"dense": {"w": np.zeros(2)}}}}, path)
    assert "subtree at ['state']" in e.value.fix
    with pytest.raises(jckpt.MissingEntryError, match=r"the file has a leaf at \['params'\]\['dense'\]"):
        jckpt.restore(jckpt.Context(), {"params": {"dense": {"w": {"x": np.zeros(2)}}}}, path)
    with pytest.raises(jckpt.MissingEntryError, match="the file holds a subtree there"):
        jckpt.restore(jckpt.Context(), {"params": {"dense": np.zeros(2)}}, path)
    # a target that matches in part lacks new leaves: no guess from a leaf of the same name
    with pytest.raises(jckpt.MissingEntryError,
                       match=r"new/w: not in the checkpoint: the file has nothing under "
                             r"the target's \['new'\]"):
        jckpt.restore(jckpt.Context(), {"params": {"dense": {"w": np.zeros(2)}}, "new": {"w": 0.0}},
                      path)


def test_a_renamed_leaf_is_shown_what_the_file_holds_beside_it(tmp_path):
    """A leaf renamed between save and restore (`w1` -> `fc1` in layer 7 of 12): the fix listed
    the file's first five entries (`embed`, layer 0's), none of them the old name."""
    path = tmp_path / "layers.jckpt"
    layer = {"attn": {"q": np.ones(2), "k": np.ones(2)}, "mlp": {"w1": np.ones(2), "w2": np.ones(2)}}
    jckpt.save(jckpt.Context(), {"embed": np.ones(2), "layers": [layer] * 12}, path)
    renamed = [dict(layer) for _ in range(12)]
    renamed[7] = {"attn": layer["attn"], "mlp": {"fc1": np.ones(2), "w2": np.ones(2)}}
    with pytest.raises(jckpt.MissingEntryError, match=r"jckpt/layers/7/mlp/fc1: not in") as e:
        jckpt.restore(jckpt.Context(), {"embed": np.ones(2), "layers": renamed}, path)
    assert "entries nearest it: ['layers/7/mlp/w1', 'layers/7/mlp/w2']" in e.value.fix


@pytest.mark.timeout(120)  # a guard against a hang, not a speed goal: it took an hour
def test_a_large_target_nested_otherwise_is_refused_at_once(tmp_path):
    """Every one of a large target's leaves missing (a tree saved from a pure dict, restored
    into its nnx.State): each was explained by a search of all the file's entries."""
    n = 30_000
    path = tmp_path / "big.jckpt"
    jckpt.save(jckpt.Context(), {f"l{i}": np.zeros(1, np.float32) for i in range(n)}, path)
    target = {f"l{i}": {"value": np.zeros(1, np.float32)} for i in range(n)}
    with pytest.raises(jckpt.MissingEntryError, match=f"{n - 1} other target leaves are missing"):
        jckpt.restore(jckpt.Context(), target, path)


def test_restore_with_namespaces_refusals(tmp_path):
    path = two_namespaces(tmp_path)
    ctx = jckpt.Context()
    for target, keys in (({"model": {"w": np.zeros(4)}}, "['model']"),
                         ({"model": {}, "opt": {}, "x": {}}, "['model', 'opt', 'x']"),
                         ([np.zeros(4)], "list")):
        with pytest.raises(InputError, match="exactly those namespaces") as e:
            jckpt.restore(ctx, target, path, namespaces=["model", "opt"])
        assert e.value.message.endswith(f"its keys are {keys}") and "target={'model'" in e.value.fix
    with pytest.raises(InputError, match="not both"):
        jckpt.restore(ctx, {"model": {"w": np.zeros(4)}}, path, namespace="model",
                      namespaces=["model"])
    with pytest.raises(jckpt.MissingEntryError, match="no namespace 'nope'.*the file holds"):
        jckpt.restore(ctx, {"nope": {"w": np.zeros(4)}}, path, namespaces="nope")
    with pytest.raises(jckpt.MissingEntryError, match="opt/nu"):
        jckpt.restore(ctx, {"opt": {"nu": np.zeros(4)}}, path, namespaces=["opt"])
    # an empty target returns at once, without opening the file
    assert jckpt.restore(ctx, {"x": {}}, tmp_path / "missing", namespaces="x") == {"x": {}}


def test_a_leaf_that_cannot_be_saved_names_the_file(tmp_path):
    """The leaf's check knows the leaf; save, the mirror and the manager add the file (it was None)."""
    path = str(tmp_path / "m.jckpt")
    with pytest.raises(InputError, match="leaf of type str") as e:
        jckpt.save(jckpt.Context(), {"s": "text"}, path)
    assert (e.value.file, e.value.entry) == (path, "jckpt/s")
    with jckpt.Mirror(tmp_path / "mirror.jckpt") as mirror:
        with pytest.raises(InputError, match="leaf of type str") as e:
            mirror.submit({"s": "text"})
        assert e.value.file == str(tmp_path / "mirror.jckpt")
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(InputError, match="leaf of type str") as e:
            mgr.save(3, {"s": "text"})
        assert e.value.file == str(tmp_path / "run" / "step_00000003.jckpt")
    assert not os.path.exists(path)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path` (from /proc/self/maps)."""
    ranges = []
    with open('/proc/self/maps') as maps:
        for line in maps:
            if line.rstrip('\n').endswith(str(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not os.path.exists('/proc/self/maps'), reason='needs /proc/self/maps')
def test_restored_cpu_arrays_are_the_mapped_file_in_place(tmp_path):
    """The zero-copy promise (docs/index.md, "Mapping" in docs/concepts.md) for `jax.Array`s:
    the CPU client takes a payload in place only at a 64-byte address, so with
    `alignment=64` every payload restored or loaded is the mapping's memory, and with
    the default alignment the largest one is."""
    from tests.helpers import cpu_devices

    rng = np.random.default_rng(0)
    tree = {f'a{i}': rng.normal(size=n).astype(dtype) for i, (n, dtype) in enumerate(
        [(3, np.float32), (1000, np.float32), (7, np.int8), (4096, np.float32),
         (5, np.float16), (100_000, np.float32), (33, ml_dtypes.bfloat16), (1 << 20, np.float32)])}
    ctx = jckpt.Context(device=cpu_devices(1)[0])
    for alignment, expect_all in ((64, True), (32, False)):
        path = (tmp_path / f'a{alignment}.jckpt').resolve()
        jckpt.save(ctx, tree, path, alignment=alignment)
        restored = jckpt.restore(ctx, jax.eval_shape(lambda: tree), path)
        _, loaded = jckpt.load(ctx, path)
        ranges = _mapped_ranges(path)
        for got in (restored, loaded['jckpt']):
            in_place = {k for k, v in got.items()
                        if any(lo <= v.unsafe_buffer_pointer() < hi for lo, hi in ranges)}
            assert in_place == set(tree) if expect_all else 'a7' in in_place, (alignment, in_place)
            for k, v in got.items():
                np.testing.assert_array_equal(np.asarray(v), tree[k])


def test_a_flax_msgpack_file_is_named_with_how_to_read_it(tmp_path):
    """flax.serialization.to_bytes (and flax.training.checkpoints without orbax) write msgpack,
    which no converter reads: restore said only "header length 2174842823 extends past the
    end of the file ... truncated or not a checkpoint"."""
    serialization = pytest.importorskip("flax.serialization")
    path = tmp_path / "checkpoint_1"
    path.write_bytes(serialization.to_bytes({"params": {"w": np.ones(3, np.float32)}, "step": 1}))
    with pytest.raises(jckpt.FormatError) as e:
        jckpt.restore(jckpt.Context(), {"step": 0}, path)
    assert e.value.message.startswith("it is a msgpack file (flax.serialization.to_bytes")
    assert "flax.serialization.from_bytes" in e.value.fix and "jckpt.save" in e.value.fix


def test_a_pickle_or_a_gzip_file_is_named_with_what_to_do(tmp_path):
    """`pickle.dump(params, f)`, the oldest way to checkpoint a JAX tree, and a compressed
    checkpoint: restore said "header length ... extends past the end of the file (fix: the
    file is truncated or not a checkpoint)"."""
    import gzip
    import pickle
    pkl, gz, good = tmp_path / "params.pkl", tmp_path / "m.jckpt.gz", tmp_path / "m.jckpt"
    pkl.write_bytes(pickle.dumps({"w": np.ones(3, np.float32)}, protocol=pickle.DEFAULT_PROTOCOL))
    jckpt.save(jckpt.Context(), {"w": np.ones(3, np.float32)}, good)
    gz.write_bytes(gzip.compress(good.read_bytes()))
    for path, kind, fix in ((pkl, "a Python pickle (pickle.dump)", "pickle.load it and jckpt.save"),
                            (gz, "a gzip-compressed file", "decompress it first")):
        with pytest.raises(jckpt.FormatError) as e:
            jckpt.restore(jckpt.Context(), {"w": np.zeros(3, np.float32)}, path)
        assert e.value.message.startswith(f"it is {kind}, not a jckpt checkpoint") and fix in e.value.fix


def test_another_formats_file_is_named_for_what_it_is_first(tmp_path):
    """docs/interop.md: given another format's file, `load` and `restore` say what it is and
    how to convert it. The error led with "header length 2415919104 extends past the end of
    the file", the other format's bytes read as a jckpt header, and said what it was after."""
    from jckpt.adapters import write

    tree = {'jckpt': {'w': np.ones(3, np.float32)}}
    for name, kind in (('w.safetensors', 'a safetensors file'), ('w.npy', 'a numpy .npy file'),
                       ('w.npz', 'a zip archive'), ('w.pt', 'a zip archive')):
        path = tmp_path / name
        write(tree, path)
        for read, target in ((jckpt.load, ()), (jckpt.restore, ({'w': np.zeros(3, np.float32)},))):
            with pytest.raises(jckpt.FormatError) as e:
                read(jckpt.Context(), *target, path)
            assert e.value.message.startswith(f'it is {kind}'), e.value.message
            assert 'not a jckpt checkpoint' in e.value.message and 'jckpt.convert' in e.value.fix


def test_a_restore_in_one_process_meets_nobody(tmp_path, monkeypatch):
    """Only a run of several processes restores together (tests/system/test_multiprocess.py)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.api import loading
    from tests.helpers import cpu_mesh

    path = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.ones(2, np.float32)}, path)
    monkeypatch.setattr(loading, "jointly", lambda *a, **k: pytest.fail("a barrier in one process"))
    abstract = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(
        cpu_mesh((2,), ("x",)), P("x")))
    assert jckpt.restore(jckpt.Context(), {"w": abstract}, path)["w"].tolist() == [1, 1]
    with pytest.raises(jckpt.MissingEntryError):
        jckpt.restore(jckpt.Context(), {"v": abstract}, path)

