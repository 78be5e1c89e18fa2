"""Property tests of the promise "restore onto any mesh, reading only what each device needs".

A tree of a few arrays (0-d, size-0 and odd dims, every stored dtype, 64-bit ones as host
arrays unless x64 is on, typed PRNG keys) is saved sharded over one mesh of the 8 CPU
devices (1 to 3 axes, any PartitionSpec the shapes allow, devices in any order, any memory
kind) as a file, as the directory form `save_directory` writes (both also in an object
store), as a directory of pieces tiled at random over several piece files and layers, or
those pieces consolidated into a file; then restored (mapped or copied, verified or not,
under `jax.set_mesh` or not, with `Context(device=...)` or not) onto other targets: another
mesh and spec, an abstract mesh, no sharding, one device, `ShapeDtypeStruct`s or live
arrays, weakly typed ones, numpy, a subset of the tree, a cast. JAX refuses shardings that
do not divide a dim (so no uneven ones here); a restore onto one is refused before any byte
is read. `load` with `Context(device=...)`, and a manager's steps with adam's state, too.

Every restored value keeps its bits (NaN payloads included) and lands on its target's
sharding; restoring one leaf reads each distinct device box of it once, only its bytes
(`jckpt.storage.lazy.record_reads`), and opens only the piece files that hold part of a
box asked for (counted at the storage backends' `open`).

The examples are few and derandomized, so CI is reproducible; hunt with more:
`JCKPT_PROPERTY_EXAMPLES=2000 pytest tests/system/test_placement_properties.py`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import warnings
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jckpt
from jckpt.api.multiprocess import save_directory
from jckpt.format.boxes import box_of, box_size, full_box, intersect
from jckpt.format.entries import entry_for
from jckpt.format.layout import written_header
from jckpt.format.names import piece_name
from jckpt.storage.backend import LOCAL
from jckpt.storage.directory import DirectoryReader, write_index
from jckpt.storage.lazy import record_reads
from jckpt.storage.object_backend import OBJECT_STORE
from jckpt.storage.writer import ArraySource, write_checkpoint
from tests.helpers import cpu_devices, cpu_mesh
from tests.properties import EXAMPLES, PROPERTY, STORED_DTYPES

STORED = STORED_DTYPES
#: What a jax array may hold here (x64 is off).
ON_DEVICE = [d for d in STORED if jax.dtypes.canonicalize_dtype(d) == d]
#: What a jax array may hold with x64 on: the 64-bit types too.
ON_DEVICE_X64 = STORED
#: The dtypes of Python numbers in JAX, which a weakly typed target has.
WEAK = [np.dtype(t) for t in ("int32", "float32", "complex64", "int64", "float64", "complex128")]
#: Dtypes a restore casts floating and integer leaves to (`cast=True`).
CAST_TO = [np.dtype("float32"), np.dtype("bfloat16"), np.dtype("float16")]
KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
#: Dims: odd ones (unsharded, or over axes of size 1), zero, and multiples of every axis size.
DIMS = [0, 1, 2, 3, 4, 5, 7, 8, 12, 16]
#: Where on a device an array may live (None: JAX's default).
MEMORY_KINDS = [None, None, "device", "pinned_host", "unpinned_host"]
MESH_SHAPES = [s for n in (1, 2, 3) for s in itertools.product((1, 2, 4, 8), repeat=n)
               if 8 % math.prod(s) == 0]


# --- strategies -----------------------------------------------------------------

@st.composite
def meshes(draw, whole=False):
    """A mesh of 1 to 3 axes over some of the 8 CPU devices, in order or shuffled (`whole`:
    `jax.make_mesh`'s over all 8)."""
    shape = draw(st.sampled_from([s for s in MESH_SHAPES if math.prod(s) == 8 or not whole]))
    names = tuple(draw(st.permutations("xyz"))[:len(shape)])
    n = math.prod(shape)
    if whole or draw(st.booleans()):
        return cpu_mesh(shape, names)
    devices = cpu_devices(8)
    order = draw(st.permutations(range(8)))[:n]
    return Mesh(np.array([devices[i] for i in order]).reshape(shape), names)


@st.composite
def named_shardings(draw, mesh, shape):
    """A NamedSharding of `mesh` that divides `shape`, in any memory kind."""
    return NamedSharding(mesh, draw(specs(mesh, shape)), memory_kind=draw(st.sampled_from(MEMORY_KINDS)))


@st.composite
def specs(draw, mesh, shape):
    """A PartitionSpec of `mesh` that divides `shape`: per dim None, an axis, or a tuple of
    axes (each axis once), trailing Nones sometimes left out."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    free = list(mesh.axis_names)
    parts: list = []
    for dim in shape:
        options: list = [None]
        for k in (1, 2):
            for axes in itertools.permutations(free, k):
                if dim % math.prod(sizes[a] for a in axes) == 0:
                    options.append(axes if k > 1 or draw(st.booleans()) else axes[0])
        part = draw(st.sampled_from(options))
        parts.append(part)
        free = [a for a in free if a not in ((part,) if isinstance(part, str) else part or ())]
    while parts and parts[-1] is None and draw(st.booleans()):
        parts.pop()
    return P(*parts)


def random_bits(seed: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array of `dtype` and `shape` of random bits (NaNs of any payload included)."""
    raw = np.random.default_rng(seed).integers(0, 256, math.prod(shape) * dtype.itemsize,
                                               dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    return array.view(np.uint8) != 0 if dtype == np.bool_ else array


@st.composite
def saved_leaves(draw, on_device=tuple(ON_DEVICE)):
    """`(kind, value saved, stored host data, key impl or None)` of one leaf (jax arrays of
    the dtypes `on_device`, numpy ones of any)."""
    on_device = list(on_device)
    kind = draw(st.sampled_from(["sharded", "sharded", "keys", "device", "host"]))
    shape = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    if kind == "keys":
        impl = draw(st.sampled_from(KEY_IMPLS))
        keys = jax.random.split(jax.random.key(seed % 2**31, impl=impl),
                                math.prod(shape)).reshape(shape)
        mesh = draw(meshes())
        keys = jax.device_put(keys, draw(named_shardings(mesh, shape)))
        return kind, keys, np.asarray(jax.random.key_data(keys)), impl
    dtype = draw(st.sampled_from(STORED if kind == "host" else on_device))
    host = random_bits(seed, dtype, shape)
    if kind == "host":  # as a device holds it, where one can (a sub-byte type's spare bits cleared)
        host = np.asarray(jax.device_put(host, cpu_devices(1)[0])) if dtype in on_device else host
        return kind, host, host, None
    if kind == "device":
        value = jax.device_put(host, cpu_devices(8)[draw(st.integers(0, 7))])
    else:
        mesh = draw(meshes())
        value = jax.device_put(host, draw(named_shardings(mesh, shape)))
    return kind, value, np.asarray(value), None  # a sub-byte type's spare bits cleared


@st.composite
def targets(draw, leaf, device_dtypes=tuple(ON_DEVICE), context=None, device=None):
    """`(kind, target leaf, expected host data, sharding the result must have or None)`, for
    a restore under `jax.set_mesh(context)` (unless None) with `Context(device=device)`."""
    _, value, host, impl = leaf
    shape = tuple(value.shape)
    on_device = impl is not None or host.dtype in device_dtypes
    kinds = ["spec", "abstract", "unsharded", "array", "device", "numpy"] if on_device \
        else ["spec", "numpy"]
    if impl is None and on_device and host.dtype in WEAK and host.size:  # (JAX's op making a
        kinds.append("weak")  # size-0 array weak over an explicit mesh gives one it cannot read)
    if impl is None and on_device and host.dtype.kind in "biuf":
        kinds.append("cast")
    kind = draw(st.sampled_from(kinds))
    if kind == "numpy":
        return kind, np.zeros(host.shape, host.dtype), host, None
    dtype = value.dtype if impl is not None else host.dtype
    expected = host
    if kind == "device":
        where = cpu_devices(8)[draw(st.integers(0, 7))]
        if draw(st.booleans()):
            one = SingleDeviceSharding(where, memory_kind=draw(st.sampled_from(MEMORY_KINDS)))
            return kind, jax.ShapeDtypeStruct(shape, dtype, sharding=one), host, \
                _put_at(one, value, impl)
        return kind, jax.device_put(_filler(value, impl), where), host, SingleDeviceSharding(where)
    if kind == "unsharded":  # jax.eval_shape's: where the Context says, else replicated over
        where = device if device is not None else NamedSharding(context, P()) \
            if context is not None else SingleDeviceSharding(cpu_devices(1)[0])  # the mesh
        # in context, else on the first device
        return kind, jax.ShapeDtypeStruct(shape, dtype), host, _put_at(where, value, impl)
    if kind == "abstract":  # nnx.eval_shape's: on the mesh in context of these axes, else
        mesh = draw(meshes(whole=True))  # on the one jax.make_mesh gives
        spec = draw(specs(mesh, shape))
        if context is not None and (context.axis_names, context.axis_sizes) == (
                mesh.axis_names, mesh.axis_sizes):
            mesh = Mesh(context.devices, mesh.axis_names, axis_types=mesh.axis_types)
        return kind, jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
            mesh.abstract_mesh, spec)), host, _put_at(NamedSharding(mesh, spec), value, impl)
    mesh = draw(meshes())
    sharding = draw(named_shardings(mesh, shape))
    if kind == "cast":
        dtype = draw(st.sampled_from([d for d in CAST_TO if d != host.dtype]))
        with np.errstate(all="ignore"):
            expected = host.astype(dtype)
    if kind == "array":
        target = jax.device_put(_filler(value, impl), sharding)
        return kind, target, host, target.sharding
    if kind == "weak":  # jax.eval_shape's of a Python number: weakly typed
        return kind, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=True), \
            host, sharding
    return kind, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), expected, \
        _put_at(sharding, value, impl) if on_device else None


def _put_at(sharding, value, impl):
    """The sharding of `value`'s like put at `sharding` (JAX writes the spec of keys over
    several devices its own way: `P()` as `P(None)`)."""
    return sharding if impl is None else jax.device_put(_filler(value, impl), sharding).sharding


def _filler(value, impl):
    """A live array of `value`'s shape and dtype (keys of its implementation), other values."""
    if impl is not None:
        return jax.random.split(jax.random.key(7, impl=impl), math.prod(value.shape)).reshape(
            value.shape)
    return np.zeros(value.shape, value.dtype)


@st.composite
def cases(draw, x64=False, context=None, device=None):
    """`(saved {name: leaf}, {name: target})` of 1 to 4 leaves (drawn with x64 on, if asked;
    targets for a restore under `jax.set_mesh(context)` with `Context(device=device)`)."""
    on_device = tuple(ON_DEVICE_X64 if x64 else ON_DEVICE)
    leaves = draw(st.lists(saved_leaves(on_device), min_size=1, max_size=4))
    names = [f"w{i}" for i in range(len(leaves))]
    return dict(zip(names, leaves)), {n: draw(targets(leaf, on_device, context, device))
                                      for n, leaf in zip(names, leaves)}


@st.composite
def places(draw):
    """Where `Context(device=...)` puts arrays: one device, or replicated over a mesh."""
    memory = draw(st.sampled_from(MEMORY_KINDS))
    if draw(st.booleans()):
        return SingleDeviceSharding(cpu_devices(8)[draw(st.integers(0, 7))], memory_kind=memory)
    return NamedSharding(draw(meshes()), P(), memory_kind=memory)


# --- the forms a tree is saved in -----------------------------------------------------

@st.composite
def tilings(draw, shape):
    """A random tiling of an array of `shape` into boxes, by guillotine cuts."""
    def cut(box, depth):
        splittable = [i for i, (a, z) in enumerate(box) if z - a > 1]
        if not splittable or depth > 2 or not draw(st.booleans()):
            return [box]
        i = draw(st.sampled_from(splittable))
        a, z = box[i]
        at = draw(st.integers(a + 1, z - 1))
        return cut((*box[:i], (a, at), *box[i + 1:]), depth + 1) + \
            cut((*box[:i], (at, z), *box[i + 1:]), depth + 1)
    return cut(full_box(shape), 0)


@st.composite
def piece_plans(draw, saved):
    """`{name: [(process, box)]}`: each array tiled at random over 1 to 3 processes' files."""
    processes = draw(st.integers(1, 3))
    return processes, {name: [(draw(st.integers(0, processes - 1)), box)
                              for box in draw(tilings(host.shape))]
                       for name, (_, _, host, _) in saved.items()}


def write_pieces(path: str, saved: dict, plan) -> None:
    """A directory checkpoint of `saved`'s host data cut as `plan` says: each process's
    pieces of an array in files of successive layers, then the index."""
    processes, boxes = plan
    os.makedirs(path)
    files: dict[tuple[int, int], tuple[list, list]] = {(p, 0): ([], []) for p in range(processes)}
    for ident, (name, (_, _, host, impl)) in enumerate(saved.items()):
        layer = dict.fromkeys(range(processes), 0)
        for p, box in boxes[name]:
            part = np.array(host[tuple(slice(a, z) for a, z in box)], order="C")  # 0-d stays 0-d
            entries, sources = files.setdefault((p, layer[p]), ([], []))
            layer[p] += 1
            entries.append(entry_for("jckpt", (("k", name),), host.dtype, part.shape, id=ident,
                                     key_impl=impl, slice=box, global_dims=host.shape))
            sources.append(ArraySource(part))
    for (p, layer), (entries, sources) in files.items():
        write_checkpoint(os.path.join(path, piece_name(p, layer)), written_header(entries, 64),
                         sources, durable=False)
    write_index(path, processes, 64, {}, durable=False)


#: How a tree is saved: one file, the directory `save_directory` writes, pieces tiled at
#: random (and those consolidated into one file); the first two in an object store too
#: (memory://, read by ranged GETs).
FORMS = ["file", "directory", "pieces", "consolidated file", "memory file", "memory directory"]


def checkpoint_path(tmp_path_factory, form: str) -> str:
    where = tmp_path_factory.mktemp("placed")
    return f"memory://placed/{where.name}/ckpt" if form.startswith("memory") else str(where / "ckpt")


def save_as(form: str, path: str, saved: dict, plan=None) -> None:
    tree = {name: leaf[1] for name, leaf in saved.items()}
    if form == "consolidated file":
        write_pieces(path + ".pieces", saved, plan)
        jckpt.consolidate(path + ".pieces", path, durable=False)
    elif form.endswith("file"):
        jckpt.save(jckpt.Context(durable=False), tree, path)
    elif form.endswith("directory"):
        save_directory(jckpt.Context(durable=False), tree, path)
    else:
        write_pieces(path, saved, plan)


# --- checks ---------------------------------------------------------------------

def raw(x) -> tuple:
    """dtype, shape and bytes of `x`; a typed PRNG key's implementation and key data's."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), raw(jax.random.key_data(x))
    x = np.asarray(x)
    return x.dtype, x.shape, np.ascontiguousarray(x).tobytes()


def check_value(name, result, target_case, impl):
    kind, _, expected, sharding = target_case
    if impl is not None and kind != "numpy":
        assert raw(result) == (impl, raw(expected)), name
    else:
        assert raw(result) == raw(expected), name
    if sharding is not None:
        assert isinstance(result, jax.Array), (name, type(result))
        assert result.sharding == sharding, (name, result.sharding, sharding)
        assert getattr(result, "weak_type", False) == (kind == "weak"), name
    else:
        assert isinstance(result, np.ndarray), (name, type(result))


def data_sharding(target, sharding, impl):
    """Where the stored data of a leaf bound for `sharding` goes: a key array's data has a
    trailing dim, laid out as the target keys' own data, or whole."""
    if impl is None or not isinstance(sharding, NamedSharding):
        return sharding
    if isinstance(target, jax.Array):
        return jax.random.key_data(target).sharding
    return NamedSharding(sharding.mesh, P(*sharding.spec, None))


def expected_boxes(shape, sharding) -> list | None:
    """The distinct boxes the devices of `sharding` hold (None: one device takes it whole)."""
    if sharding is None or len(sharding.device_set) < 2:
        return None
    return sorted({box_of(index, shape) for index in sharding.devices_indices_map(shape).values()})


@contextlib.contextmanager
def opened_files():
    """The base names of the checkpoint files opened while active (at the storage backends)."""
    names: list[str] = []
    with contextlib.ExitStack() as stack:
        for backend in (LOCAL, OBJECT_STORE):
            def open_(path, real=backend.open, **kw):
                names.append(os.path.basename(path))
                return real(path, **kw)
            stack.enter_context(mock.patch.object(backend, "open", open_))
        yield names


def check_reads(path, form, name, target_case, impl, options):
    """Restoring `name` alone reads each distinct device box once, and only its bytes, and
    opens only the piece files that hold part of what is read."""
    kind, target, expected, sharding = target_case
    host = expected if kind != "cast" else None
    with opened_files() as opened, record_reads() as log:
        got = jckpt.restore(target={name: target}, path=path, cast=kind == "cast",
                            **options)[name]
    assert sharding is None or got.sharding == sharding, (name, got.sharding, sharding)
    stored = DirectoryReader(path).arrays if not form.endswith("file") else None
    shape = tuple(expected.shape)
    itemsize = (host.dtype if host is not None else stored_entry(path, name).dtype).itemsize
    boxes = expected_boxes(shape, data_sharding(target, sharding, impl))
    if boxes is None:  # one device or the host: the whole array, read at most once
        assert [b for b, _ in log] in ([], [full_box(shape)]), (name, log)
        boxes = [full_box(shape)]
    else:
        assert sorted(log) == [(b, box_size(b) * itemsize) for b in boxes], (name, log)
    if stored is None:
        assert opened == [os.path.basename(path)], opened
        return
    if form.startswith("memory"):  # a URL is first asked for as one object, then as a prefix
        opened = [n for n in opened if n != os.path.basename(path)]
    (array,) = [a for a in stored.values() if a.entry.name == f"jckpt/{name}"]
    files = DirectoryReader(path).files
    need = {files[fi] for fi, piece in array.pieces for b in boxes
            if intersect(piece, b) is not None}  # () for 0-d boxes
    assert opened[0] == "index.jckpt" and sorted(opened[1:]) == sorted(need), (name, opened, need)


def stored_entry(path, name):
    (entry,) = [e for e in jckpt.describe(path).tensors if e.name == f"jckpt/{name}"]
    return entry


# --- the properties -----------------------------------------------------------------

@PROPERTY
@given(form=st.sampled_from(FORMS), x64=st.booleans(), verify=st.sampled_from([None, True, False]),
       mmap=st.booleans(), data=st.data())
def test_a_tree_restores_onto_any_target_reading_only_what_each_device_needs(
        tmp_path_factory, form, x64, verify, mmap, data):
    context = data.draw(st.one_of(st.none(), meshes()))
    device = data.draw(st.one_of(st.none(), places()))
    with jax.enable_x64(x64), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 64-bit leaves stay host arrays without x64
        saved, wanted = data.draw(cases(x64, context, device))
        plan = data.draw(piece_plans(saved)) if form in ("pieces", "consolidated file") else None
        path = checkpoint_path(tmp_path_factory, form)
        save_as(form, path, saved, plan)
        with jax.set_mesh(context) if context is not None else contextlib.nullcontext():
            restore_and_check(path, form, saved, wanted, data, ctx=jckpt.Context(device=device),
                              verify=verify, mmap=mmap)


def restore_and_check(path, form, saved, wanted, data, **options):
    """The whole tree restored, then a subset of it, then each of its leaves alone (with
    `restore`'s `options`)."""
    cast = any(t[0] == "cast" for t in wanted.values())
    back = jckpt.restore(target={n: t[1] for n, t in wanted.items()}, path=path, cast=cast,
                         **options)
    assert sorted(back) == sorted(wanted)
    for name, target_case in wanted.items():
        check_value(name, back[name], target_case, saved[name][3])
    subset = data.draw(st.lists(st.sampled_from(sorted(wanted)), min_size=1, unique=True))
    part = jckpt.restore(target={n: wanted[n][1] for n in subset}, path=path, cast=cast,
                         **options)
    assert sorted(part) == sorted(subset)
    for name in subset:
        check_value(name, part[name], wanted[name], saved[name][3])
        check_reads(path, form, name, wanted[name], saved[name][3], options)


@PROPERTY
@given(leaf=saved_leaves(), form=st.sampled_from(["file", "directory"]), data=st.data())
def test_a_target_sharding_that_does_not_divide_is_refused_before_any_read(
        tmp_path_factory, leaf, form, data):
    value = leaf[1]
    shape = tuple(value.shape)
    mesh = data.draw(meshes())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    bad = [(i, a) for i, d in enumerate(shape) for a in mesh.axis_names if d % sizes[a]]
    if not bad:
        return
    i, axis = data.draw(st.sampled_from(bad))
    spec = P(*([None] * i), axis)
    target = jax.ShapeDtypeStruct(shape, value.dtype, sharding=NamedSharding(mesh, spec))
    path = str(tmp_path_factory.mktemp("refused") / "ckpt")
    save_as(form, path, {"w": leaf})
    with record_reads() as log, pytest.raises(jckpt.MismatchError) as err:
        jckpt.restore(jckpt.Context(), {"w": target}, path)
    assert err.value.entry == "jckpt/w" and log == []


@PROPERTY
@given(form=st.sampled_from(FORMS), data=st.data())
def test_load_puts_every_array_where_the_context_says(tmp_path_factory, form, data):
    """`load` with `Context(device=...)` (one device, or replicated over a mesh): every array
    there with its bits, each read once; 64-bit ones (x64 is off) stay host arrays."""
    saved, _ = data.draw(cases())
    plan = data.draw(piece_plans(saved)) if form in ("pieces", "consolidated file") else None
    path = checkpoint_path(tmp_path_factory, form)
    save_as(form, path, saved, plan)
    where = data.draw(places())
    with warnings.catch_warnings(), record_reads() as log:
        warnings.simplefilter("ignore", UserWarning)
        _, tree = jckpt.load(jckpt.Context(device=where), path)
    assert sorted(tree["jckpt"]) == sorted(saved)
    full = []
    for name, (_, value, host, impl) in saved.items():
        got = tree["jckpt"][name]
        if impl is not None:
            assert raw(got) == (impl, raw(host)), name
            assert got.sharding == _put_at(where, value, impl), name
        else:
            assert raw(got) == raw(host), name
            if host.dtype in ON_DEVICE:
                assert got.sharding == where, (name, got.sharding, where)
            else:
                assert isinstance(got, np.ndarray), name
        full.append((full_box(host.shape), host.nbytes))
    assert not collections.Counter(log) - collections.Counter(full), log  # each at most once


# --- the manager ----------------------------------------------------------------------

@st.composite
def training_states(draw):
    """`(params saved on one mesh, the same arrays' targets on another)`."""
    save_mesh, restore_mesh = draw(meshes()), draw(meshes())
    params, targets_ = {}, {}
    for i in range(draw(st.integers(1, 3))):
        # no size-0 dims: adam's update of one sharded over an explicit mesh is an array
        # whose shards JAX's own np.asarray cannot assemble (jax 0.10)
        shape = tuple(draw(st.lists(st.sampled_from(DIMS[1:]), min_size=1, max_size=2)))
        dtype = draw(st.sampled_from([np.dtype("float32"), np.dtype("bfloat16")]))
        host = random_bits(draw(st.integers(0, 2**32 - 1)), dtype, shape)
        params[f"w{i}"] = jax.device_put(host, NamedSharding(save_mesh,
                                                              draw(specs(save_mesh, shape))))
        targets_[f"w{i}"] = NamedSharding(restore_mesh, draw(specs(restore_mesh, shape)))
    return params, targets_, restore_mesh


@pytest.mark.slow
@settings(PROPERTY, max_examples=max(5, EXAMPLES // 3))  # a manager's steps are slower
@given(state=training_states(), directory_steps=st.booleans())
def test_manager_restores_the_latest_step_onto_another_mesh(tmp_path_factory, state,
                                                            directory_steps):
    """Two steps of params and adam's state saved on one mesh; the latest restores onto
    another mesh's shardings exactly."""
    import optax

    params, shardings, mesh = state
    opt = optax.adam(1e-3)
    first = opt.init(params)
    later = jax.tree.map(lambda p: p + 1, params)
    _, second = opt.update(params, first, params)
    replicated = NamedSharding(mesh, P())

    spec = {"params": {n: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=shardings[n])
                       for n, p in params.items()},
            "opt": _opt_spec(second, shardings, replicated)}
    directory = str(tmp_path_factory.mktemp("mgr"))
    with jckpt.CheckpointManager(directory, ctx=jckpt.Context(durable=False),
                                 directory_steps=directory_steps or None) as mgr:
        for step, tree in ((1, {"params": params, "opt": first}),
                           (2, {"params": later, "opt": second})):
            if directory_steps:  # a step directory holds one namespace
                mgr.save(step, tree, force=True)
            else:
                mgr.save(step, items=tree, force=True)
        mgr.wait_durable()
        back = mgr.restore(target=spec, namespaces=None if directory_steps else ["params", "opt"])
    assert back.step == 2
    for got, want, where in zip(jax.tree.leaves(back.tree),
                                jax.tree.leaves({"params": later, "opt": second}),
                                jax.tree.leaves(spec)):
        assert raw(got) == raw(want)
        assert got.sharding == where.sharding


def _opt_spec(state, shardings, replicated):
    """Targets of adam's state: moments where their params go, the count replicated."""
    def one(path, x):
        name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=shardings.get(name, replicated) if x.ndim else replicated)
    return jax.tree_util.tree_map_with_path(one, state)
