"""Device images of a snapshot, and what survives donation of the submitted buffers.

jax arrays are imaged on their device, the CPU included (from
`image.CPU_IMAGE_BYTES` up), so these tests run the same copies, donation of
old images and draining as an accelerator does.
"""

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.trees import compiled, image, transfers

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def state(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((256, 128), dtype=np.float32)),  # imaged
            "b": jnp.asarray(rng.standard_normal(32).astype(ml_dtypes.bfloat16)),
            "step": jnp.int32(seed), "mask": jnp.asarray(rng.random(5) > 0.5),
            "key": jax.random.key(seed), "host": rng.standard_normal(7).astype(np.float32)}


def expected_bytes(tree):
    """Each leaf's bytes (a typed key's data), copied now."""
    return {k: np.array(jax.random.key_data(v) if k == "key" else v).tobytes() for k, v in tree.items()}


@jax.jit
def _train(t):
    return {**t, "w": t["w"] * 0.5 + 1, "b": t["b"] + 1, "step": t["step"] + 1,
            "mask": ~t["mask"], "key": jax.random.split(t["key"], 1)[0]}


train_step = jax.jit(_train, donate_argnums=0)


def run_and_check(tmp_path, make_writer, save, n=3):
    """Submit, then donate every submitted jax buffer and overwrite numpy leaves in place."""
    path = tmp_path / "run"
    wanted = []
    with make_writer(path) as writer:
        for i in range(n):
            tree = state(i)
            wanted.append(expected_bytes(tree))
            save(writer, tree, i)
            host = tree.pop("host")
            host[:] = -1.0  # the caller reuses its numpy buffer
            tree = train_step(tree)  # and donates its device buffers
            jax.block_until_ready(tree)
        counters = writer.counters
    return wanted, counters


@pytest.mark.parametrize("limit", [None, 0])
def test_mirror_file_is_the_state_at_submit_despite_donation(tmp_path, limit):
    wanted, counters = run_and_check(tmp_path, lambda p: jckpt.Mirror(p, device_image_bytes=limit),
                                     lambda m, t, i: m.submit(t))
    assert counters.images == (0 if limit == 0 else 3)
    _, got = jckpt.load(jckpt.Context(host=True), tmp_path / "run")
    assert expected_bytes(got["jckpt"]) == wanted[-1]


def test_manager_steps_are_the_states_at_save_despite_donation(tmp_path):
    wanted, counters = run_and_check(
        tmp_path, lambda p: jckpt.CheckpointManager(p), lambda m, t, i: m.save(i, tree=t))
    assert counters.images == 3
    with jckpt.CheckpointManager(tmp_path / "run") as m:
        for step, want in enumerate(wanted):
            got = m.restore(step).tree["jckpt"]
            assert expected_bytes(got) == want


def test_a_slot_copies_into_its_old_image_once_its_copy_is_compiled():
    images = image.Images()
    first = images.take([jnp.ones(4), jnp.zeros((2, 2), jnp.int8), jax.random.key(0)])
    assert not any(a.is_deleted() for a in first)
    compiled.wait_all()  # compiled in the background meanwhile
    second = images.take([jnp.full(4, 3.0), jnp.ones((2, 2), jnp.int8), jax.random.key(1)])
    assert all(a.is_deleted() for a in first)  # donated: the second image is in its buffers
    assert np.asarray(second[0]).tolist() == [3.0] * 4
    assert np.asarray(second[2]).tolist() == np.asarray(jax.random.key_data(jax.random.key(1))).tolist()
    third = images.take([jnp.ones(5)])  # another shape: a fresh image, another compilation
    assert not any(a.is_deleted() for a in second) and np.asarray(third[0]).tolist() == [1.0] * 5


def test_a_mirror_reuses_its_images_memory_from_snapshot_to_snapshot(tmp_path):
    """After the first snapshots, each one is written into the image the slot already has:
    the drained views of it are released once it is durable, so it can be donated."""
    tree = {"w": jnp.arange(32768.0), "b": jnp.ones(10, jnp.int32)}  # w is imaged, b copied
    with jckpt.Mirror(tmp_path / "m.jckpt", slots=1) as m:
        pointers = []
        for i in range(4):
            m.submit(jax.tree.map(lambda x, i=i: x + i, tree))
            m.wait_durable()
            slot_images = m._pipeline._free[0]._images
            compiled.wait_all()
            pointers.append(slot_images._image[0].unsafe_buffer_pointer())
    assert len(set(pointers[1:])) == 1  # one buffer from the second snapshot on
    _, got = jckpt.load(jckpt.Context(host=True), tmp_path / "m.jckpt")
    assert got["jckpt"]["w"].tolist() == (np.arange(32768.0) + 3).tolist()


def test_small_cpu_arrays_are_copied_and_large_ones_imaged():
    small, large = jnp.ones(100), jnp.ones(image.CPU_IMAGE_BYTES // 4)
    assert not image.imageable(small) and image.imageable(large)
    assert not image.imageable(np.ones(100_000)) and not image.imageable(3.0)
    leaves = [small, np.ones(100_000), large, 3.0, jax.random.key(0), large + 1]
    assert image.imageable_indices(leaves) == [i for i, x in enumerate(leaves) if image.imageable(x)] \
        == [2, 5]


def test_no_room_or_a_zero_limit_copies_to_host_at_submit(tmp_path, monkeypatch, caplog):
    assert not image.has_room([jnp.ones(1000)], limit=100)
    assert image.has_room([jnp.ones(10)], limit=None)
    with jckpt.Mirror(tmp_path / "m.jckpt", device_image_bytes=0) as m:
        with caplog.at_level(logging.INFO, logger="jckpt"):
            m.submit({"w": jnp.ones(1 << 16)})
        m.wait_durable()
        assert m.counters.images == 0
    assert any("copying to host at submit" in r.getMessage() for r in caplog.records)  # docs/mirror.md
    monkeypatch.setattr(image, "_memory_stats", lambda d: {"bytes_limit": 1000, "bytes_in_use": 990})
    assert not image.has_room([jnp.ones(100)], limit=None)


def test_device_bytes_counts_every_shard_and_replica_as_the_shards_say():
    """The per-device count (one-device arrays counted whole, without listing their shards)
    equals the sum over each array's addressable shards, for every kind of placement."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.helpers import cpu_mesh
    mesh = cpu_mesh((4, 2), ("a", "b"))
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    arrays = [jnp.ones(10), jnp.ones((3, 5), jnp.int8), jax.random.split(jax.random.key(0), 3),
              jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
              jax.device_put(x, NamedSharding(mesh, P("a"))),  # replicated over "b"
              jax.device_put(x, NamedSharding(mesh, P()))]  # on all 8
    want: dict = {}
    for a in arrays:
        for s in a.addressable_shards:
            want[s.device] = want.get(s.device, 0) + s.data.nbytes
    assert image.device_bytes(arrays) == want
    assert image.image_bytes(arrays) == sum(want.values()) == 10 * 4 + 15 + 3 * 8 + 256 * (1 + 2 + 8)


def test_the_image_limit_is_checked(tmp_path):
    with pytest.raises(jckpt.InputError, match="device_image_bytes"):
        jckpt.Mirror(tmp_path / "never.jckpt", device_image_bytes=-1)
    assert not (tmp_path / "never.jckpt").exists()


@pytest.mark.parametrize("host_memory", ["pinned_host", None])
@pytest.mark.parametrize("limit", [None, 0])
def test_images_and_direct_copies_of_an_accelerator_survive_donation(accelerator, tmp_path,
                                                                     monkeypatch, limit, host_memory):
    """The CPU taken for an accelerator: every jax leaf is imaged (or, at limit 0, moved to host
    at submit), and drained into pinned host memory or fresh buffers."""
    monkeypatch.setattr(transfers, "SNAPSHOT_MEMORY", host_memory)
    moved = []
    real = transfers.start_host_copies
    monkeypatch.setattr(transfers, "start_host_copies",
                        lambda a, snapshot=False: (moved.append((len(a), snapshot)),
                                                   real(a, snapshot))[1])
    wanted, counters = run_and_check(tmp_path, lambda p: jckpt.Mirror(p, device_image_bytes=limit),
                                     lambda m, t, i: m.submit(t))
    assert counters.images == (0 if limit == 0 else 3)
    assert [(n, s) for n, s in moved if n] == [(5, True)] * 3  # each snapshot's jax leaves
    _, got = jckpt.load(jckpt.Context(host=True), tmp_path / "run")
    assert expected_bytes(got["jckpt"]) == wanted[-1]


@pytest.mark.parametrize("limit", [None, 0])
def test_many_small_leaves_of_an_accelerator_drain_joined_and_survive_donation(
        accelerator, tmp_path, monkeypatch, limit):
    monkeypatch.setattr(compiled, "_CALLS", {})
    sent = []
    real = transfers._start
    monkeypatch.setattr(transfers, "_start", lambda a, m: (sent.append(len(a)), real(a, m))[1])
    step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    tree = {f"b{i}": jnp.full(3 + i % 5, float(i)) for i in range(40)}
    with jckpt.Mirror(tmp_path / "m.jckpt", device_image_bytes=limit) as m:
        for _ in range(3):
            want = {k: np.array(v) for k, v in tree.items()}
            m.submit(tree)
            tree = step(tree)  # donates what was submitted
            m.wait_durable()
            compiled.wait_all()
            _, got = jckpt.load(jckpt.Context(host=True), tmp_path / "m.jckpt")
            assert {k: v.tobytes() for k, v in got["jckpt"].items()} == \
                {k: v.tobytes() for k, v in want.items()}
    assert [n for n in sent if n] == [40, 1, 1]  # one by one, then joined
