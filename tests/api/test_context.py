"""Context and Registry: immutable values; load registers what it read."""

import dataclasses
import os

import numpy as np
import pytest

import jckpt
from jckpt.api.context import Context, Registry, check_context
from jckpt.errors import ClashError, InputError
from jckpt.format.entries import entry_for


def test_context_defaults_and_is_frozen():
    ctx = Context()
    assert (ctx.namespace, ctx.alignment, ctx.mmap, ctx.durable, ctx.host, ctx.device) == (
        "jckpt", 32, True, True, False, None)
    assert len(ctx.registry) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.namespace = "x"  # type: ignore[misc]
    assert hash(Context(namespace="a")) == hash(Context(namespace="a"))


def test_replace_returns_a_new_context_and_validates():
    ctx = Context()
    other = ctx.replace(namespace="student", host=True)
    assert (other.namespace, other.host) == ("student", True)
    assert (ctx.namespace, ctx.host) == ("jckpt", False)
    with pytest.raises(InputError, match="invalid namespace"):
        ctx.replace(namespace="no-dash")
    with pytest.raises(InputError, match="alignment must be a power of two"):
        ctx.replace(alignment=0)
    for bad in (True, 1 << 25, 64.0, "64"):
        with pytest.raises(InputError, match="alignment must be a power of two"):
            ctx.replace(alignment=bad)
    assert type(ctx.replace(alignment=np.int64(128)).alignment) is int  # numpy's ints are ints
    with pytest.raises(InputError):
        Context(namespace="")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ctx.replace(colour="red")


def test_repr_shows_what_differs_and_what_was_loaded():
    assert repr(Context()) == "Context(namespace='jckpt')"
    assert repr(Context(namespace="s", durable=False)) == "Context(namespace='s', durable=False)"
    reg = Registry().add([entry_for("a", (("k", "w"),), np.float32, (2,), id=3)])
    assert repr(Context(registry=reg)) == "Context(namespace='jckpt', registry=Registry(1 entry in [a]))"


def test_registry_is_a_value_holding_identities_and_max_ids():
    empty = Registry()
    e1 = entry_for("a", (("k", "w"),), np.float32, (2,), id=3)
    e2 = entry_for("a", (("k", "b"),), np.float32, (2,), id=1)
    e3 = dataclasses.replace(entry_for("ocannl", None, np.float32, (2,), id=9), path=None)
    reg = empty.add([e1, e2, e3])
    assert len(empty) == 0 and len(reg) == 3
    assert ("a", (("k", "w"),)) in reg and ("ocannl", 9) in reg and ("a", (("k", "x"),)) not in reg
    assert (reg.max_id("a"), reg.max_id("ocannl"), reg.max_id("other")) == (3, 9, -1)
    again = reg.add([entry_for("a", (("k", "z"),), np.float32, (1,), id=2)])
    assert again.max_id("a") == 3 and len(again) == 4 and len(reg) == 3
    assert reg == empty.add([e3, e2, e1])  # equal values, whatever the order added
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.identities = frozenset()  # type: ignore[misc]


def test_load_registers_and_refuses_a_clash(tmp_path):
    path = tmp_path / "m.jckpt"
    jckpt.save(Context(), {"w": np.ones(2), "b": np.zeros(2)}, path)
    ctx0 = Context(host=True)
    ctx1, _ = jckpt.load(ctx0, path)
    assert len(ctx0.registry) == 0 and len(ctx1.registry) == 2  # the argument is unchanged
    with pytest.raises(ClashError, match="already loaded into this context"):
        jckpt.load(ctx1, path)
    ctx2, tree = jckpt.load(ctx1, path, prefix_namespace="twin")
    assert list(tree) == ["twin__jckpt"] and len(ctx2.registry) == 4
    # ids saved later in a loaded namespace stay above every id loaded into it
    jckpt.save(ctx2, {"new": np.ones(1)}, tmp_path / "n.jckpt")
    assert [e.id for e in jckpt.describe(tmp_path / "n.jckpt").tensors] == [2]


def test_check_context_refuses_what_is_not_a_context():
    ctx = Context()
    assert check_context(ctx) is ctx
    for bad in (None, "jckpt", {"namespace": "jckpt"}):
        with pytest.raises(InputError, match="ctx must be a jckpt.Context") as err:
            check_context(bad)
        assert "jckpt.Context()" in err.value.fix


def test_replace_refuses_an_unknown_field_naming_the_known_ones():
    with pytest.raises(InputError, match="Context has no field 'nmespace'") as err:
        Context().replace(nmespace="x")
    assert "namespace" in err.value.fix


@pytest.mark.parametrize('field', ['mmap', 'durable', 'host'])
@pytest.mark.parametrize('value', ['x', 'False', 1, 0, [], None])
def test_context_flags_must_be_bools(field, value):
    with pytest.raises(InputError, match=f"Context's {field} must be True or False") as e:
        Context(**{field: value})
    assert e.value.fix == f"pass {field}=True or {field}=False"
    assert getattr(Context(**{field: np.bool_(False)}), field) is False  # numpy's bools are bools


@pytest.mark.parametrize('device', ['x', 'cpu:0', 3, object()])
def test_context_device_must_be_a_device_or_a_sharding(device):
    import jax

    with pytest.raises(InputError, match="device must be a jax.Device or a jax.sharding.Sharding") as e:
        Context(device=device)
    assert "jax.devices()[0]" in e.value.fix
    cpu = jax.devices("cpu")[0]
    assert Context(device=cpu).device is cpu
    sharding = jax.sharding.SingleDeviceSharding(cpu)
    assert Context(device=sharding).device is sharding


def test_context_registry_must_be_a_registry():
    with pytest.raises(InputError, match="registry must be a Registry"):
        Context(registry='x')
    with pytest.raises(InputError, match="mmap must be True or False"):
        Context().replace(mmap='no')


@pytest.mark.parametrize('call', [
    lambda p: jckpt.save(Context(), {'w': np.ones(2)}, p, appending='yes'),
    lambda p: jckpt.save(Context(), {'w': np.ones(2)}, p, progress='yes'),
    lambda p: jckpt.load(Context(), p, mmap='no'),
    lambda p: jckpt.load(Context(), p, verify='no'),
    lambda p: jckpt.load(Context(), p, progress=1),
    lambda p: jckpt.restore(Context(), {'w': np.ones(2)}, p, cast='yes'),
    lambda p: jckpt.restore(Context(), {'w': np.ones(2)}, p, mmap='no'),
    lambda p: jckpt.restore(Context(), {'w': np.ones(2)}, p, verify='no'),
], ids=['save-appending', 'save-progress', 'load-mmap', 'load-verify', 'load-progress',
        'restore-cast', 'restore-mmap', 'restore-verify'])
def test_save_load_restore_refuse_flags_that_are_not_bools(tmp_path, call):
    path = tmp_path / 'w.jckpt'
    jckpt.save(Context(), {'w': np.arange(2.0)}, path)
    before = path.read_bytes()
    with pytest.raises(InputError, match="must be True or False"):
        call(path)
    assert path.read_bytes() == before  # refused before anything was touched


def test_a_call_without_its_context_names_the_context_not_the_path(tmp_path):
    """`jckpt.save(tree, path, x)`: the tree sits where ctx goes, and that is what is said."""
    tree, path = {"a": np.ones(2)}, str(tmp_path / "x.jckpt")
    jckpt.save(Context(), tree, path)
    for call in (lambda: jckpt.save(tree, path, "y.jckpt"),
                 lambda: jckpt.restore(tree, path, "y.jckpt"),
                 lambda: jckpt.load(path, "y.jckpt")):
        with pytest.raises(InputError, match="ctx must be a jckpt.Context") as err:
            call()
        assert "jckpt.Context()" in err.value.fix
    assert not os.path.exists(tmp_path / "y.jckpt")
