"""Property tests across every path that writes a pytree and reads it back.

Each path must give back exactly what was written (dtype, shape, bits, and the
target's structure) or refuse with a `jckpt.CheckpointError`. Trees have odd
but legal keys (unicode, spaces, dots, slashes, empty strings, integers),
lists, tuples, NamedTuples, registered dataclasses, None leaves and empty
containers; leaves of every stored dtype in any memory layout, numpy and Python
scalars, typed PRNG keys and jax arrays, sharded ones included.

The examples are few and derandomized, so CI is reproducible; hunt with more:
`JCKPT_PROPERTY_EXAMPLES=2000 pytest tests/system/test_properties.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os

import jax
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jckpt
import jckpt.adapters
from jckpt.adapters import safetensors as st_adapter
from jckpt.tools import cli
from jckpt.trees import pytree
from tests.helpers import LAYOUTS, cpu_devices, cpu_mesh, laid_out
from tests.properties import EXAMPLES, PROPERTY, STORED_DTYPES

DTYPES = STORED_DTYPES
#: What a jax array may hold here (x64 is off), packed sub-byte types aside.
DEVICE_DTYPES = [d for d in DTYPES if jax.dtypes.canonicalize_dtype(d) == d
                 and d.name not in ("int2", "uint2")]


class Pair(collections.namedtuple("Pair", "first second")):
    """A NamedTuple node."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
    """A dataclass registered as a pytree node."""
    left: object
    right: object


# --- strategies -----------------------------------------------------------------

@st.composite
def host_arrays(draw, dtypes=DTYPES, scalar=False):
    dtype = draw(st.sampled_from(dtypes))
    shape = () if scalar else draw(st.one_of(
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), st.just((1,) * 12)))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # any bits, NaNs included
    if dtype == np.bool_:  # numpy makes bools 0 or 1 (a byte of 2 is no bool tensorstore reads)
        array = array.view(np.uint8) != 0
    layout = draw(st.sampled_from((*LAYOUTS, "reversed")))
    if layout == "reversed":
        return array[::-1].copy()[::-1] if array.ndim else array
    return laid_out(array, layout)


def numpy_scalars(dtypes=DTYPES):
    return host_arrays(dtypes, scalar=True).map(lambda a: a[()])


python_scalars = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1),
                           st.floats(allow_nan=False), st.complex_numbers(allow_nan=False))


@st.composite
def prng_keys(draw):
    impl = draw(st.sampled_from(["threefry2x32", "rbg", "unsafe_rbg"]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    keys = jax.random.split(jax.random.key(draw(st.integers(0, 2**31 - 1)), impl=impl),
                            int(np.prod(shape)))
    return keys.reshape(shape)


@st.composite
def device_arrays(draw):
    """A jax array on one CPU device, or sharded over the 8-device CPU mesh."""
    array = draw(host_arrays(DEVICE_DTYPES))
    array = np.ascontiguousarray(array, array.dtype.newbyteorder("="))
    if draw(st.booleans()) or array.ndim == 0 or array.shape[0] % 4:
        return jax.device_put(array, cpu_devices(1)[0])
    mesh = cpu_mesh((4, 2), ("a", "b"))
    return jax.device_put(array, NamedSharding(mesh, draw(st.sampled_from([P("a"), P(), P(None)]))))


leaves = st.one_of(host_arrays(), host_arrays(), numpy_scalars(), python_scalars, prng_keys(),
                   device_arrays())

odd_keys = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=5),
    st.sampled_from(["", " ", ".", "/", "a/", "a/b", "a.b", "a", "0", "-1", "n0", "é", "∑", "k k",
                     "\\", '"', '\\"', "(", ")", ";", "#|", "|#", "\n", "\r\n", "\t",
                     "\u2028", "\x7f", "[0]", "'a'", "__metadata__", "jckpt.paths"]))


def containers(children):
    return st.one_of(
        st.dictionaries(odd_keys, children, max_size=4),
        st.dictionaries(st.one_of(st.integers(-2**63, 2**63 - 1),
                                  st.sampled_from([10**20 - 1, -(10**20 - 1), 2**64 - 1])),
                        children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.builds(Pair, children, children),
        st.builds(Node, children, children),
        st.sampled_from([None, {}, [], ()]))


trees = st.recursive(leaves, containers, max_leaves=8)


# --- comparisons ----------------------------------------------------------------

def bits(x):
    """What must survive a round trip: key implementation, dtype, shape and bytes."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), bits(jax.random.key_data(x))
    x = np.asarray(x)
    dtype = x.dtype.newbyteorder("=") if x.dtype.byteorder in "<>" else x.dtype
    return dtype, x.shape, np.ascontiguousarray(x).astype(dtype).tobytes()


def stored_bits(x):
    """`bits` of a leaf as stored: Python numbers are 64-bit, keys are their data."""
    if type(x) is bool:
        return bits(np.bool_(x))
    if type(x) in (int, float, complex):
        return bits(np.asarray(x, {int: np.int64, float: np.float64, complex: np.complex128}[type(x)]))
    return bits(x)


def same_leaf(written, read):
    """A leaf restored into itself as the target comes back as itself, exactly."""
    assert bits(read) == bits(written) or stored_bits(read) == stored_bits(written), (written, read)
    if type(written) in (bool, int, float, complex):
        assert type(read) is type(written)
    elif isinstance(written, np.generic):
        assert isinstance(read, np.generic)


def same_tree(written, read):
    assert jax.tree.structure(read) == jax.tree.structure(written)
    for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(read)):
        same_leaf(a, b)


def loose(tree, *, key_data=False):
    """`{loose path: stored bits}`: what `load` (no target) must give back (typed PRNG keys
    as their key data with `key_data`: what a format without key types holds)."""
    return {pytree.loose_path(p): stored_bits(stored_host(leaf) if key_data else leaf)
            for p, leaf in pytree.flatten(tree)}


def loaded(path, namespace="jckpt", **kw):
    _, tree = jckpt.load(jckpt.Context(host=True), path, **kw)
    return tree.get(namespace, {})


# --- jckpt files ----------------------------------------------------------------

@PROPERTY
@given(tree=trees, alignment=st.sampled_from([1, 32, 4096]), mmap=st.booleans())
def test_file_restore_and_load_give_back_the_tree(tmp_path_factory, capsys, tree, alignment, mmap):
    """`restore` into the tree gives it back exactly; `load`, the same leaves at its paths;
    `verify` passes and `inspect --json` lists each leaf's dtype, shape and key type."""
    path = str(tmp_path_factory.mktemp("file") / "t.jckpt")
    jckpt.save(jckpt.Context(alignment=alignment, durable=False), tree, path)
    same_tree(tree, jckpt.restore(jckpt.Context(host=True), tree, path, mmap=mmap))
    if jax.tree.leaves(tree):
        assert loose(loaded(path, mmap=mmap)) == loose(tree)
    assert jckpt.verify(path).ok
    assert cli.main(["verify", path]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", "--json", path]) == 0
    listed = json.loads(capsys.readouterr().out)["entries"]
    assert sorted((e["dtype"], tuple(e["shape"]), e["key_impl"] or "") for e in listed) == sorted(
        map(inspected, jax.tree.leaves(tree)))


def inspected(leaf):
    """What `inspect --json` lists of a leaf: its stored dtype, its shape (a key array's, not
    its key data's) and its key implementation ("" for none)."""
    impl, (d, shape, _) = described(leaf)
    return str(d), tuple(leaf.shape) if impl else shape, impl or ""


def described(leaf):
    """`(key implementation or None, stored bits)` of a leaf."""
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(leaf)), stored_bits(jax.random.key_data(leaf))
    return None, stored_bits(leaf)


@PROPERTY
@given(first=trees, second=trees, third=trees)
def test_namespaces_append_and_prefix_keep_every_tree(tmp_path_factory, first, second, third):
    """`a` then `b` appended, then `a` again appended: `b` whole, `a` the third tree's leaves
    over the first's; a prefixed load renames the namespaces and changes nothing else."""
    path = str(tmp_path_factory.mktemp("ns") / "m.jckpt")
    ctx = jckpt.Context(durable=False)
    jckpt.save(ctx.replace(namespace="a"), first, path)
    jckpt.save(ctx.replace(namespace="b"), second, path, appending=True)
    ids = {(e.namespace, e.path): e.id for e in jckpt.describe(path).tensors}
    try:
        jckpt.save(ctx.replace(namespace="a"), third, path, appending=True)
        expected_a = {**loose(first), **loose(third)}
    except jckpt.CheckpointError:  # a leaf of one tree where the other has a node
        expected_a = loose(first)
    after = jckpt.describe(path).tensors
    for e in after:  # a kept or replaced entry keeps its id; a new one gets a fresh id
        assert ids.get((e.namespace, e.path), e.id) == e.id
    for ns in ("a", "b"):
        assert len({e.id for e in after if e.namespace == ns}) == sum(e.namespace == ns
                                                                     for e in after)
    same_tree(second, jckpt.restore(jckpt.Context(host=True), second, path, namespace="b"))
    _, tree = jckpt.load(jckpt.Context(host=True), path, prefix_namespace="p")
    assert loose(tree.get("p__b", {})) == loose(second)
    assert loose(tree.get("p__a", {})) == expected_a
    assert cli.main(["verify", path]) == 0


# --- directories, sharded arrays, other meshes -----------------------------------

@st.composite
def sharded_trees(draw):
    """`{name: array}` of arrays sharded over a 2x4 mesh, and the shardings of another mesh."""
    mesh, other = cpu_mesh((2, 4), ("x", "y")), cpu_mesh((4, 2), ("y", "x"))
    flat, deep = [P(), P("x"), P("y"), P(("x", "y"))], [P(None, "y"), P("x", "y")]
    arrays, targets = {}, {}
    for name in draw(st.lists(odd_keys, min_size=1, max_size=4, unique=True)):
        dtype = draw(st.sampled_from(DEVICE_DTYPES))
        shape = draw(st.sampled_from([(8,), (8, 4), (0, 4), (16, 8, 2)]))
        n = int(np.prod(shape)) * dtype.itemsize
        host = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype).reshape(shape)
        if draw(st.integers(0, 4)) == 0:  # typed PRNG keys of that shape
            impl = draw(st.sampled_from(["threefry2x32", "rbg"]))
            host = jax.random.split(jax.random.key(n, impl=impl), math.prod(shape)).reshape(shape)
        specs = st.sampled_from(flat + deep if len(shape) > 1 else flat)
        arrays[name] = jax.device_put(host, NamedSharding(mesh, draw(specs)))
        spec = draw(specs)
        targets[name] = jax.ShapeDtypeStruct(shape, arrays[name].dtype,
                                             sharding=NamedSharding(other, spec))
    return arrays, targets


@PROPERTY
@given(case=sharded_trees(), directory=st.booleans())
def test_sharded_arrays_restore_onto_another_mesh(tmp_path_factory, case, directory):
    from jckpt.api.multiprocess import save_directory

    arrays, targets = case
    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    if directory:
        save_directory(jckpt.Context(durable=False), arrays, path)
    else:
        jckpt.save(jckpt.Context(durable=False), arrays, path)
    back = jckpt.restore(jckpt.Context(), targets, path)
    for name, array in arrays.items():
        assert back[name].sharding.is_equivalent_to(targets[name].sharding, len(array.shape))
        assert bits(back[name]) == bits(array)
    assert loose(loaded(path)) == loose(arrays)
    assert cli.main(["verify", path]) == 0


# --- the mirror and the manager -------------------------------------------------

@PROPERTY
@given(versions=st.lists(trees, min_size=1, max_size=3))
def test_mirror_durable_file_holds_the_last_tree(tmp_path_factory, versions):
    path = str(tmp_path_factory.mktemp("mirror") / "m.jckpt")
    with jckpt.Mirror(path, ctx=jckpt.Context(durable=False)) as mirror:
        for tree in versions:
            mirror.submit(tree)
        mirror.wait_durable()
    last = versions[-1]
    same_tree(last, jckpt.restore(jckpt.Context(host=True), last, path))
    if jax.tree.leaves(last):
        assert loose(loaded(path)) == loose(last)


@PROPERTY
@given(params=trees, opt=trees, step=st.integers(0, 2**40))
def test_manager_restores_a_training_state(tmp_path_factory, params, opt, step):
    directory = str(tmp_path_factory.mktemp("mgr"))
    trainer = jckpt.TrainerState(global_step=step, consumed_batches=step, learning_rate=1e-3)
    with jckpt.CheckpointManager(directory, ctx=jckpt.Context(durable=False)) as mgr:
        mgr.save(step, items={"params": params, "opt": opt}, trainer_state=trainer,
                 metrics={"loss": 0.5}, force=True)
        mgr.wait_durable()
        whole = mgr.restore(target={"params": params, "opt": opt}, namespaces=["params", "opt"],
                            ctx=jckpt.Context(host=True))
        plain = mgr.restore(ctx=jckpt.Context(host=True))
    assert whole.step == step and whole.trainer_state.global_step == step
    assert whole.metrics == {"loss": 0.5}
    same_tree({"params": params, "opt": opt}, whole.tree)
    for ns, tree in {"params": params, "opt": opt}.items():
        assert loose(plain.tree.get(ns, {})) == loose(tree)


# --- other formats ----------------------------------------------------------------

#: Each format's file name extension, and the dtypes it holds (None: every one jckpt stores).
FORMATS = {
    "safetensors": ("safetensors", [st_adapter.DTYPES[n].newbyteorder("=") for n in st_adapter.DTYPES]),
    "safetensors index": ("safetensors.index.json",
                          [st_adapter.DTYPES[n].newbyteorder("=") for n in st_adapter.DTYPES]),
    "npz": ("npz", None),
    "npy": ("npy", None),
    "ocannl": ("jckpt", None),
    "torch": ("pt", None),
    "orbax": ("orbax", None),
}
#: The formats that record the tree's nodes without arrays beside its paths, and read them back.
RECORD_EMPTY_NODES = {"safetensors", "safetensors index", "npz", "torch"}


def stored_host(x):
    """A leaf as a format without key types holds it: a typed PRNG key as its key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def leaf_bits(tree):
    return sorted((str(d), shape, data) for d, shape, data in
                  (stored_bits(stored_host(x)) for x in jax.tree.leaves(tree)))  # dtypes: no order


def write_and_read(tmp_path_factory, tree, fmt, namespaces=None):
    """A format's write and read give back the tree's leaves exactly, at its paths where
    the format keeps them, or the write refuses with a CheckpointError and leaves no file.
    `namespaces` (`{namespace: subtree}`) writes several namespaces instead."""
    ext, dtypes = FORMATS[fmt]
    path = str(tmp_path_factory.mktemp("fmt") / f"x.{ext}")
    written = namespaces or {"jckpt": tree}
    try:
        jckpt.adapters.write(written, path, format=fmt.split()[0])
    except jckpt.CheckpointError:
        assert not os.path.exists(path)
        return None
    if dtypes is not None:
        assert all(np.asarray(stored_host(x)).dtype.newbyteorder("=") in dtypes
                   for x in jax.tree.leaves(written)), f"{fmt} wrote a dtype it does not hold"
    back = jckpt.adapters.read(path, format=fmt.split()[0])
    if namespaces is not None and fmt != "npy":  # a namespace without arrays: recorded, or left out
        assert sorted(back) == sorted(ns for ns, sub in written.items()
                                      if fmt in RECORD_EMPTY_NODES or jax.tree.leaves(sub))
    for ns, sub in written.items():
        if fmt in ("npy", "orbax"):  # npy: one unnamed array; orbax: integer keys become strings
            assert leaf_bits(back.get(ns, {})) == leaf_bits(sub)
        else:
            assert loose(back.get(ns, {}), key_data=True) == loose(sub, key_data=True)
    return path


@PROPERTY
@given(tree=trees, fmt=st.sampled_from(sorted(set(FORMATS) - {"orbax"})))
def test_adapters_write_exactly_or_refuse(tmp_path_factory, tree, fmt):
    write_and_read(tmp_path_factory, tree, fmt)


@PROPERTY
@given(namespaces=st.dictionaries(st.sampled_from(["jckpt", "opt", "ema_2"]), trees,
                                  min_size=2, max_size=3),
       fmt=st.sampled_from(sorted(set(FORMATS) - {"orbax", "npy"})))
def test_adapters_keep_namespaces_apart(tmp_path_factory, namespaces, fmt):
    write_and_read(tmp_path_factory, None, fmt, namespaces)


@settings(PROPERTY, max_examples=max(5, EXAMPLES // 3))  # orbax writes are the slowest
@given(tree=trees)
def test_orbax_writes_exactly_or_refuses(tmp_path_factory, tree):
    """What the orbax writer wrote reads back, and restores into the tree as it is (but
    for integer dict keys, which orbax records as strings)."""
    path = write_and_read(tmp_path_factory, tree, "orbax")
    if path is not None and not any(kind == "ki" for p, _ in pytree.flatten(tree) for kind, _ in p):
        same_tree(tree, jckpt.restore(jckpt.Context(host=True), tree, os.path.join(path, "jckpt")))


@PROPERTY
@given(tree=trees, fmt=st.sampled_from(["safetensors", "npz", "jckpt"]))
def test_convert_out_and_back_keeps_every_leaf(tmp_path_factory, tree, fmt):
    """jckpt -> fmt -> jckpt with the CLI: the same leaves at the same paths, or a refusal."""
    d = tmp_path_factory.mktemp("convert")
    src, mid, back = str(d / "a.jckpt"), str(d / f"b.{fmt}"), str(d / "c.jckpt")
    jckpt.save(jckpt.Context(durable=False), tree, src)
    if cli.main(["convert", src, mid]) != 0:
        assert not os.path.exists(mid)
        return
    assert cli.main(["inspect", mid]) == 0
    assert cli.main(["convert", mid, back]) == 0
    assert cli.main(["verify", back]) == 0
    if jax.tree.leaves(tree):
        assert loose(loaded(back), key_data=True) == loose(tree, key_data=True)


@st.composite
def gpt2_trees(draw):
    """A tiny GPT-2 tree of the form the llm.c adapter reads (dimensions sometimes ones
    llm.c cannot hold), in one dtype and memory layout, with its `config`."""
    from jckpt.adapters import llmc

    dims = [draw(st.integers(0, 3)) for _ in range(4)]  # layers, heads, channels, max_seq_len
    vocab, padded = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    config = llmc.Config(max_seq_len=dims[3], vocab_size=vocab, num_layers=dims[0],
                         num_heads=dims[1], channels=dims[2], padded_vocab_size=padded)
    dtype = draw(st.sampled_from([np.dtype("<f4"), np.dtype(">f4"), np.dtype("bfloat16"),
                                  np.dtype("float16")]))
    layout = draw(st.sampled_from(LAYOUTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = dict(llmc.param_shapes(config))

    def param(kind):
        return laid_out(rng.normal(size=shapes[kind]).astype(dtype), layout)

    tree = {"wte": param("wte"), "wpe": param("wpe"),
            "ln_f": {"weight": param("lnfw"), "bias": param("lnfb")},
            "config": {"num_heads": np.int32(config.num_heads), "vocab_size": np.int32(vocab)},
            "h": []}
    for _ in range(config.num_layers):
        layer: dict = {}
        for kind, where, per_layer in llmc.KINDS:
            if per_layer:
                node = layer
                for key in where[:-1]:
                    node = node.setdefault(key, {})
                node[where[-1]] = param(kind)
        tree["h"].append(layer)
    return tree


@PROPERTY
@given(tree=gpt2_trees())
def test_llmc_writes_exactly_or_refuses(tmp_path_factory, tree):
    path = str(tmp_path_factory.mktemp("llmc") / "gpt2.bin")
    try:
        jckpt.adapters.write({"jckpt": tree}, path, format="llmc")
    except jckpt.CheckpointError:
        assert not os.path.exists(path)
        return
    back = jckpt.adapters.read(path, format="llmc")["jckpt"]
    params = {k: v for k, v in loose(tree).items() if k[0] != ("name", "config")}
    assert {k: v for k, v in loose(back).items() if k[0] != ("name", "config")} == params
    assert cli.main(["convert", path, path + ".jckpt"]) == 0
    assert cli.main(["convert", path + ".jckpt", path + ".again.bin"]) == 0
    assert open(path, "rb").read() == open(path + ".again.bin", "rb").read()


@PROPERTY
@given(model=trees, opt=trees, form=st.sampled_from(["jckpt", "directory", "safetensors", "npz"]))
def test_manager_steps_of_every_form_restore_exactly(tmp_path_factory, model, opt, form):
    """A step as one file, as a directory of pieces (one namespace), or with its model in
    another format: what was saved comes back exactly, or the save is refused."""
    assume(model is not None or form != "directory")  # save(step, None) is a save of nothing
    directory = str(tmp_path_factory.mktemp("mgr"))
    saved = {"jckpt": model} if form == "directory" else {"model": model, "opt": opt}
    with jckpt.CheckpointManager(directory, ctx=jckpt.Context(durable=False),
                                 directory_steps=form == "directory" or None) as mgr:
        try:
            if form == "directory":
                mgr.save(1, model, force=True)
            else:
                mgr.save(1, items=saved, options=jckpt.CheckpointOptions(format=form), force=True)
            mgr.wait_durable()
        except jckpt.CheckpointError:
            assert form in ("safetensors", "npz")  # a format that cannot hold the model
            return
        plain = mgr.restore(ctx=jckpt.Context(host=True))
    for ns, tree in saved.items():
        foreign = ns == "model" and form in ("safetensors", "npz")
        assert loose(plain.tree.get(ns, {}), key_data=foreign) == loose(tree, key_data=foreign)


@PROPERTY
@given(tree=trees, alignment=st.sampled_from([1, 8, 64, 4096]), in_place=st.booleans())
def test_relayout_keeps_every_entry(tmp_path_factory, tree, alignment, in_place):
    """`convert --alignment` (a relayout) keeps each entry's bits, path, id and key type."""
    d = tmp_path_factory.mktemp("relayout")
    src = str(d / "a.jckpt")
    dst = src if in_place else str(d / "b.jckpt")
    jckpt.save(jckpt.Context(durable=False), tree, src)
    before = jckpt.describe(src)
    assert cli.main(["convert", src, dst, "--alignment", str(alignment)]) == 0
    after = jckpt.describe(dst)
    assert after.alignment == alignment
    assert [(e.id, e.path, e.key_impl, e.checksum) for e in after.tensors] == [
        (e.id, e.path, e.key_impl, e.checksum) for e in before.tensors]
    same_tree(tree, jckpt.restore(jckpt.Context(host=True), tree, dst))
    assert jckpt.verify(dst).ok
