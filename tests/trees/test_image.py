"""Device images of a snapshot, and what survives donation of the submitted buffers.

The image path is for accelerators; here it runs on the CPU device by taking
it for an accelerator (`placement._on_cpu` patched), which exercises the same
jitted copies, donation of old images and draining.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.trees import image, placement

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def as_accelerator(monkeypatch):
    monkeypatch.setattr(placement, "_on_cpu", lambda leaf: False)


def state(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32)),
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


def test_mirror_file_is_the_state_at_submit_despite_donation(tmp_path, monkeypatch):
    for accelerator in (False, True):
        if accelerator:
            as_accelerator(monkeypatch)
        d = tmp_path / str(accelerator)
        d.mkdir()
        wanted, counters = run_and_check(d, lambda p: jckpt.Mirror(p), lambda m, t, i: m.submit(t))
        assert counters.images == (3 if accelerator else 0)
        _, got = jckpt.load(jckpt.Context(host=True), d / "run")
        last = wanted[-1]
        assert expected_bytes(got["jckpt"]) == last


def test_manager_steps_are_the_states_at_save_despite_donation(tmp_path, monkeypatch):
    as_accelerator(monkeypatch)
    wanted, counters = run_and_check(
        tmp_path, lambda p: jckpt.CheckpointManager(p), lambda m, t, i: m.save(i, tree=t))
    assert counters.images == 3
    with jckpt.CheckpointManager(tmp_path / "run") as m:
        for step, want in enumerate(wanted):
            got = m.restore(step).tree["jckpt"]
            assert expected_bytes(got) == want


def test_a_slot_copies_into_its_old_image_when_shapes_match(monkeypatch):
    calls = []
    real = image._copy_into
    monkeypatch.setattr(image, "_copy_into", lambda old, new: (calls.append(len(old)),
                                                               real(old, new))[1])
    first = image.take_image([jnp.ones(4), jnp.zeros((2, 2), jnp.int8)], None)
    second = image.take_image([jnp.full(4, 3.0), jnp.ones((2, 2), jnp.int8)], first)
    assert calls == [2] and all(a.is_deleted() for a in first)  # donated, reused
    assert np.asarray(second[0]).tolist() == [3.0] * 4
    third = image.take_image([jnp.ones(5)], second)  # another shape: a fresh image
    assert calls == [2] and np.asarray(third[0]).tolist() == [1.0] * 5


def test_no_room_or_a_zero_limit_copies_to_host_at_submit(tmp_path, monkeypatch):
    as_accelerator(monkeypatch)
    assert not image.has_room([jnp.ones(1000)], limit=100)
    assert image.has_room([jnp.ones(10)], limit=None)
    with jckpt.Mirror(tmp_path / "m.jckpt", device_image_bytes=0) as m:
        m.submit({"w": jnp.ones(3)})
        m.wait_durable()
        assert m.counters.images == 0
    monkeypatch.setattr(image, "_memory_stats", lambda d: {"bytes_limit": 1000, "bytes_in_use": 990})
    assert not image.has_room([jnp.ones(100)], limit=None)


def test_the_image_limit_is_checked(tmp_path):
    with pytest.raises(jckpt.InputError, match="device_image_bytes"):
        jckpt.Mirror(tmp_path / "never.jckpt", device_image_bytes=-1)
    assert not (tmp_path / "never.jckpt").exists()
