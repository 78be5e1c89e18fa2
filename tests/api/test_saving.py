"""The entries of a save built in C (`jckpt.format.leaf_entries`) equal those built in Python.

`jckpt.api.saving.ACCELERATE` switches between the two; every leaf the C
path leaves alone (large, non-contiguous, Fortran-order, big-endian, sharded,
a path it cannot label) goes through Python, so both give the same entries,
sources and files for any tree.
"""

import os
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jckpt
import jckpt.adapters
from jckpt.api import saving
from jckpt.errors import InputError
from jckpt.format import precs
from jckpt.storage import writer
from jckpt.storage.writer import SMALL_PAYLOAD, ArraySource, BytesSource
from jckpt.trees import to_host
from tests.helpers import LAYOUTS, cpu_devices, laid_out

DTYPES = [precs.dtype_of(p) for p in sorted(precs.ALL_PRECS - {"Void_prec", "Uint4x32_prec"})]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    size = draw(st.sampled_from([None, SMALL_PAYLOAD - 1, SMALL_PAYLOAD, SMALL_PAYLOAD + 1]))
    if size is None:
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    else:  # around the small limit, in bytes where the element size allows
        shape = (size // dtype.itemsize,)
    raw = draw(st.binary(min_size=8, max_size=8)) * -(-int(np.prod(shape)) * dtype.itemsize // 8)
    array = np.frombuffer(raw[:int(np.prod(shape)) * dtype.itemsize], dtype=dtype).reshape(shape).copy()
    return laid_out(array, draw(st.sampled_from(LAYOUTS)))


components = st.one_of(
    st.tuples(st.sampled_from(["k", "a"]), st.text(st.characters(codec="utf-8", exclude_characters="\x00"),
                                                    max_size=5)),
    st.tuples(st.sampled_from(["i", "ki", "f"]), st.integers(-2**70, 2**70)))
leaves = st.lists(st.tuples(st.lists(components, max_size=4).map(tuple), arrays()), max_size=8)


def host_leaves(items):
    """Host leaves as `save` makes them, and the same arrays as given (big-endian ones kept)."""
    made = to_host.host_leaves([(str(p), a) for p, a in items])
    return made + [to_host.HostLeaf(a.dtype.newbyteorder("="), a.shape, None, a)
                   for p, a in items if a.dtype.byteorder == ">"]


def both(paths, hosts, alignment, namespace="jckpt"):
    """`saving._entries` in Python, then with the accelerator."""
    found = []
    for accelerate in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(saving, "ACCELERATE", accelerate)
            found.append(saving._entries(jckpt.Context(namespace=namespace), paths, hosts,
                                         alignment=alignment))
    return found


def same_sources(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y)
        if isinstance(x, BytesSource):
            assert x.checksum == y.checksum and type(x.data) is type(y.data)
            assert memoryview(x.data).tobytes() == memoryview(y.data).tobytes()
        elif isinstance(x, ArraySource):
            assert x.array is y.array


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(items=leaves, alignment=st.sampled_from([1, 32, 64, 4096]))
def test_c_and_python_build_the_same_entries(items, alignment):
    hosts = host_leaves(items)
    paths = [p for p, _ in items] + [p for p, a in items if a.dtype.byteorder == ">"]
    (py_entries, py_sources), (c_entries, c_sources) = both(paths, hosts, alignment)
    assert c_entries == py_entries
    assert repr(c_entries) == repr(py_entries)
    same_sources(py_sources, c_sources)


def test_typed_keys_and_unicode_paths_take_the_c_path():
    keys = jax.random.split(jax.random.key(3, impl="rbg"), 2)
    items = [((("k", "κλειδί"), ("i", 0)), keys), ((("a", "b"), ("ki", -5)), np.arange(3, dtype=np.int16)),
             ((), np.float32(2.5))]
    hosts = to_host.host_leaves([(str(p), a) for p, a in items])
    py, c = both([p for p, _ in items], hosts, 64, namespace="opt")
    assert c[0] == py[0] and repr(c[0]) == repr(py[0])
    assert c[0][0].key_impl == "rbg" and c[0][0].label == ("κλειδί", "0")
    same_sources(py[1], c[1])


def test_a_path_too_deep_is_refused_either_way(monkeypatch):
    path = (("i", 0),) * 300
    hosts = to_host.host_leaves([("deep", np.zeros(2))])
    for accelerate in (False, True):
        monkeypatch.setattr(saving, "ACCELERATE", accelerate)
        with pytest.raises(InputError, match="deeper than"):
            saving._entries(jckpt.Context(), [path], hosts, alignment=32)


@pytest.mark.parametrize("alignment", [1, 64, 4096])
def test_files_are_byte_identical_with_and_without_c(monkeypatch, tmp_path, alignment):
    rng = np.random.default_rng(0)
    tree = {"small": [rng.standard_normal(n).astype(np.float32) for n in (0, 1, 7, 1000)],
            "big": rng.standard_normal(SMALL_PAYLOAD).astype(np.float64),
            "fortran": np.asfortranarray(rng.standard_normal((5, 3))), "key": jax.random.key(1),
            "be": np.arange(4, dtype=">i4"), "scalar": np.int64(9), "flags": np.array([True, False])}
    files = []
    for accelerate in (False, True):
        monkeypatch.setattr(saving, "ACCELERATE", accelerate)
        path = tmp_path / f"{accelerate}.jckpt"
        jckpt.save(jckpt.Context(durable=False, alignment=alignment), tree, path)
        files.append(path.read_bytes())
    assert files[0] == files[1]
    back = jckpt.restore(jckpt.Context(host=True), tree, tmp_path / "True.jckpt")
    assert np.array_equal(back["small"][3], tree["small"][3]) and np.array_equal(back["be"], tree["be"])


def _cpu_arrays():
    """A small CPU `jax.Array` of every dtype JAX holds as it is (under 64-bit off: none of
    64 bits), of several shapes: empty, 0-d, 2-D, and dtypes JAX exports no buffer of."""
    rng = np.random.default_rng(1)
    out = {}
    for dtype in DTYPES:
        if dtype.itemsize > 8 or (dtype.itemsize == 8 and dtype.kind != "c"):
            continue
        for shape in [(), (0,), (3, 5), (1000,)]:
            data = rng.integers(0, 2, shape).astype(dtype) if dtype.kind in "biu" else \
                rng.uniform(-1, 1, shape).astype(dtype)
            out[f"{dtype.name}{shape}"] = jax.device_put(data, cpu_devices()[0])
    return out


def test_cpu_arrays_save_the_same_file_with_and_without_c(monkeypatch, tmp_path):
    tree = _cpu_arrays()
    assert all(v.dtype == np.asarray(v).dtype for v in tree.values())
    files = []
    for accelerate in (False, True):
        monkeypatch.setattr(saving, "ACCELERATE", accelerate)
        monkeypatch.setattr(to_host, "ACCELERATE", accelerate)
        monkeypatch.setattr(writer, "accelerator", writer.accelerator if accelerate else None)
        path = tmp_path / f"{accelerate}.jckpt"
        jckpt.save(jckpt.Context(durable=False), tree, path)
        files.append(path.read_bytes())
    as_numpy = tmp_path / "numpy.jckpt"
    jckpt.save(jckpt.Context(durable=False), {k: np.asarray(v) for k, v in tree.items()}, as_numpy)
    assert files[0] == files[1] == as_numpy.read_bytes()
    want = {k: np.asarray(v) for k, v in tree.items()}
    back = jckpt.restore(jckpt.Context(host=True), want, tmp_path / "True.jckpt")
    assert all(np.asarray(back[k]).tobytes() == v.tobytes() for k, v in want.items())


def test_a_small_cpu_array_is_written_from_its_own_buffer():
    """Its payload is a view of the `jax.Array`'s buffer, not of a numpy array made of it
    (which costs more to make and to free than the export)."""
    tree = {"w": jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3), cpu_devices()[0])}
    items = [(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
    hosts = to_host.host_leaves([(str(p), x) for p, x in items], keep_cpu=True)
    _, (source,) = saving._entries(jckpt.Context(), [(("k", "w"),)], hosts, alignment=32)
    assert type(source.data) is memoryview and source.data.obj is tree["w"]
    assert bytes(source.data) == np.arange(6, dtype=np.float32).tobytes()


def test_a_directory_in_the_way_is_refused_before_anything_is_written(tmp_path):
    """A save onto a plain directory wrote the whole staging file, then failed to rename it."""
    target = tmp_path / "taken.jckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    for appending in (False, True):
        with pytest.raises(jckpt.InputError, match="a directory that holds no directory checkpoint"):
            jckpt.save(jckpt.Context(), {"w": np.ones(2)}, target, appending=appending)
    assert sorted(os.listdir(tmp_path)) == ["taken.jckpt"] and os.listdir(target) == ["notes.txt"]


def test_a_failed_directory_save_names_the_checkpoint_not_its_staging(tmp_path, monkeypatch):
    import errno

    from jckpt.api import multiprocess
    from jckpt.storage.publish import storage_error

    def full(where, *args):
        raise storage_error(OSError(errno.ENOSPC, "No space left on device"), "writing",
                            os.path.join(where, "process_00000.jckpt"))

    monkeypatch.setattr(multiprocess, "_write_pieces", full)
    path = tmp_path / "dir.jckpt"
    with pytest.raises(jckpt.StorageError, match="No space") as e:
        multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, path)
    assert e.value.file == str(path / "process_00000.jckpt") and "free disk space" in e.value.fix
    assert os.listdir(tmp_path) == []


def test_appending_to_a_directory_checkpoint_is_refused_and_leaves_it_whole(tmp_path):
    """docs/sharding.md: `appending=True` is not supported for directory checkpoints."""
    from jckpt.api import multiprocess

    path = tmp_path / "dir.jckpt"
    multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, path)
    before = sorted(os.listdir(path))
    with pytest.raises(jckpt.InputError, match="appending is not supported for directory") as e:
        jckpt.save(jckpt.Context(), {"b": np.zeros(3)}, path, appending=True)
    assert e.value.file == str(path) and e.value.fix
    assert sorted(os.listdir(path)) == before and os.listdir(tmp_path) == ["dir.jckpt"]
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(host=True), path)[1]["jckpt"]["w"], np.ones(2))


def test_a_directory_save_never_deletes_a_folder_of_other_files(tmp_path):
    """`save_directory` into a folder of the user's files published over it and deleted them,
    and `save` over a directory checkpoint deleted a file put beside its pieces."""
    from jckpt.api import multiprocess

    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(jckpt.InputError, match=r"saving a directory checkpoint would replace a "
                                               r"directory holding 2 entries that are no part "
                                               r"of a checkpoint \(notes.txt, sub\)") as e:
        multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, mine)
    assert e.value.file == str(mine) and "move what is there out" in e.value.fix
    assert sorted(os.listdir(mine)) == ["notes.txt", "sub"]
    path = tmp_path / "dir.jckpt"
    multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, path)
    multiprocess.save_directory(jckpt.Context(), {"w": np.zeros(2)}, path)  # its own: replaced
    (path / "notes.txt").write_text("precious")
    with pytest.raises(jckpt.InputError, match=r"no part of a checkpoint \(notes.txt\)"):
        jckpt.save(jckpt.Context(), {"w": np.ones(2)}, path)
    assert (path / "notes.txt").read_text() == "precious"


def test_a_directory_checkpoint_whose_writer_died_publishing_is_replaced(tmp_path):
    """A writer killed between publishing and removing its lock leaves `.writer.lock` in the
    published directory: that is the checkpoint's own, and the next save replaces it."""
    from jckpt.api import multiprocess
    from jckpt.format.names import DIRECTORY_LOCK_NAME

    path = tmp_path / "dir.jckpt"
    multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, path)
    (path / DIRECTORY_LOCK_NAME).write_text("")
    multiprocess.save_directory(jckpt.Context(), {"w": np.zeros(2)}, path)
    assert jckpt.restore(jckpt.Context(), {"w": np.ones(2)}, path)["w"].tolist() == [0.0, 0.0]


def test_a_link_to_a_plain_directory_is_replaced_like_any_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    link = tmp_path / "ckpt.jckpt"
    os.symlink(elsewhere, link)
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, link)
    assert not os.path.islink(link) and jckpt.load(jckpt.Context(), link)[1]["jckpt"]["w"][0] == 1
    assert os.listdir(elsewhere) == ["notes.txt"]


def test_save_file_writes_one_file_whatever_the_process_count(tmp_path, monkeypatch):
    """What orbax's handler calls on process 0: never the multi-process collective."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(saving, "save_directory", lambda *a, **k: pytest.fail("a collective"))
    saving.save_file(jckpt.Context(), {"w": np.arange(3.0)}, tmp_path / "one.jckpt")
    assert jckpt.load(jckpt.Context(), tmp_path / "one.jckpt")[1]["jckpt"]["w"][2] == 2
    with pytest.raises(InputError, match="ctx must be a jckpt.Context"):
        saving.save_file({"w": np.ones(1)}, tmp_path / "x.jckpt", tmp_path / "y.jckpt")


class _Pair(NamedTuple):
    a: Any
    b: Any


@pytest.mark.parametrize("first, second", [
    (np.float32(1), {"w": np.ones(2)}),                           # root leaf, then a node
    ({"w": np.ones(2)}, np.float32(1)),                           # a node, then a root leaf
    ({"x": np.ones(2)}, {"x": {"y": np.ones(2)}}),                # leaf, then a node there
    ({"x": {"y": np.ones(2)}}, {"x": np.ones(2)}),                # node, then a leaf there
    ({"a": np.ones(2)}, _Pair(np.ones(2), np.zeros(2))),          # dict key, then a field
    ({1: np.ones(2)}, [np.ones(2), np.zeros(2)]),                 # int key, then an index
    ({1: np.ones(2)}, {"w": np.ones(2)}),                         # int keys, then str keys
], ids=["root-node", "node-root", "leaf-node", "node-leaf", "key-field", "key-index", "mixed-keys"])
def test_an_appended_tree_that_does_not_fit_the_kept_entries_is_refused(tmp_path, first, second):
    """The file would hold two trees in one namespace that no load could rebuild."""
    path = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), first, path)
    before = path.read_bytes()
    with pytest.raises(InputError, match="would not form one tree") as err:
        jckpt.save(jckpt.Context(), second, path, appending=True)
    assert err.value.file == str(path) and "without appending" in err.value.fix
    assert err.value.entry is None or err.value.entry.startswith("jckpt/")
    assert path.read_bytes() == before
    jckpt.save(jckpt.Context(namespace="other"), second, path, appending=True)  # its own namespace
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert sorted(tree) == ["jckpt", "other"]


def test_an_appended_tree_that_fits_replaces_and_extends(tmp_path):
    path = tmp_path / "m.jckpt"
    jckpt.save(jckpt.Context(), {"x": {"y": np.ones(2)}, "l": [np.ones(1)]}, path)
    jckpt.save(jckpt.Context(), {"x": {"z": np.zeros(3)}, "l": [np.ones(1), np.zeros(1)]}, path,
               appending=True)
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert sorted(tree["jckpt"]["x"]) == ["y", "z"] and len(tree["jckpt"]["l"]) == 2


def test_an_append_that_fills_the_empty_nodes_drops_them_from_the_record(tmp_path):
    """The old file's `jckpt.empty_nodes` stayed in the header once an appending save filled
    every node it named: the record must describe the file, namespace by namespace."""
    path, opt = tmp_path / "c.jckpt", jckpt.Context(namespace="opt")
    jckpt.save(opt, [np.zeros(2), ()], path, metadata={"note": "kept"})
    jckpt.save(opt, [np.zeros(2), np.ones(3)], path, appending=True)
    assert "jckpt.empty_nodes" not in jckpt.describe(path).metadata_dict()
    jckpt.save(opt, [np.zeros(2), ()], tmp_path / "d.jckpt")
    jckpt.save(jckpt.Context(namespace="params"), {"w": np.zeros(2), "b": None},
               tmp_path / "d.jckpt", appending=True)
    jckpt.save(opt, [np.zeros(2), np.ones(3)], tmp_path / "d.jckpt", appending=True)
    assert jckpt.describe(tmp_path / "d.jckpt").metadata_dict()["jckpt.empty_nodes"] == \
        '{"params": [[["k", "b"]]]}'
    assert jckpt.describe(path).metadata_dict()["note"] == "kept"


def test_an_append_of_nodes_under_an_empty_node_keeps_them_visible(tmp_path):
    """A namespace saved as `optax.sgd`'s empty state (its root one empty node), then appended
    `{"z": ()}`: the root record stayed, so reading the file gave the namespace as `None` and
    hid `z`. A node that now holds another is no longer empty."""
    import optax

    path, opt = tmp_path / "e.jckpt", jckpt.Context(namespace="opt", durable=False)
    jckpt.save(jckpt.Context(durable=False), {"w": np.zeros(2)}, path)
    jckpt.save(opt, optax.EmptyState(), path, appending=True)
    jckpt.save(opt, {"z": ()}, path, appending=True)
    assert jckpt.adapters.read(path)["opt"] == {"z": None}


@pytest.mark.parametrize("appending", [False, True])
def test_a_link_to_a_file_is_replaced_and_its_target_left_alone(tmp_path, appending):
    """docs/reliability.md: a checkpoint path that is a symlink is replaced, not followed; the
    file it pointed at stays as it was, and an appending save reads the old entries through it."""
    real = tmp_path / "real.jckpt"
    jckpt.save(jckpt.Context(), {"old": np.zeros(2)}, real)
    before = real.read_bytes()
    link = tmp_path / "ckpt.jckpt"
    os.symlink(real, link)
    jckpt.save(jckpt.Context(), {"new": np.ones(2)}, link, appending=appending)
    assert not os.path.islink(link) and real.read_bytes() == before
    names = [e.name for e in jckpt.describe(link).tensors]
    assert names == (["jckpt/old", "jckpt/new"] if appending else ["jckpt/new"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt.jckpt", "real.jckpt"]


def test_durable_fsyncs_the_file_and_its_directory_and_durable_false_none(tmp_path, monkeypatch):
    """docs/concepts.md: `durable` fsyncs the file and its directory when publishing;
    `durable=False` skips the fsyncs, while the rename stays atomic."""
    import stat

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for durable in (True, False):
        synced.clear()
        path = tmp_path / f"{durable}.jckpt"
        for appending in (False, True):
            jckpt.save(jckpt.Context(durable=durable), {"w": np.ones(3)}, path, appending=appending)
        assert synced == (["file", "directory"] * 2 if durable else []), synced
    assert sorted(os.listdir(tmp_path)) == ["False.jckpt", "True.jckpt"]



def test_a_save_over_a_directory_checkpoint_lists_it_once(tmp_path, monkeypatch):
    """`save` looked for files no checkpoint writes twice: in `check_target`, then in
    `save_directory`; a directory of many pieces (a large run's) was listed twice."""
    from jckpt.api import multiprocess

    path = tmp_path / "dir.jckpt"
    multiprocess.save_directory(jckpt.Context(), {"w": np.ones(2)}, path)
    listed = []
    for name in ("listdir", "scandir"):
        real = getattr(os, name)

        def spy(p=".", _real=real):
            if not isinstance(p, int):  # a directory's descriptor
                listed.append(os.path.abspath(os.fspath(p)))
            return _real(p)

        monkeypatch.setattr(os, name, spy)
    jckpt.save(jckpt.Context(), {"w": np.zeros(2)}, path)
    monkeypatch.undo()
    assert listed.count(str(path)) == 1
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(host=True), path)[1]["jckpt"]["w"], np.zeros(2))
