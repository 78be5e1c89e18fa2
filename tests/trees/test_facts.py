"""What a sharding says about where its data lives (facts.of), asked once per sharding."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jckpt.trees import facts
from tests.helpers import cpu_mesh


def sharded(x, spec):
    return jax.device_put(x, NamedSharding(cpu_mesh((4, 2), ("a", "b")), spec))


def test_each_placement_is_described():
    cpu = jax.devices("cpu")[0]
    one = facts.of(jax.device_put(np.ones(2), cpu).sharding)
    assert one == facts.Placement(on_cpu=True, several=False, whole=True, device=cpu)
    rows, everywhere = sharded(np.ones((8, 2)), P("a")), sharded(np.ones((8, 2)), P())
    for array in (rows, everywhere):
        placed = facts.of(array.sharding)
        assert placed.on_cpu and placed.several and placed.whole and placed.device is None
        assert facts.is_sharded(array)
    assert not facts.is_sharded(jax.numpy.ones(2)) and not facts.is_sharded(np.ones(2))


def test_shardings_known_by_identity_stay_few_and_right(monkeypatch):
    monkeypatch.setattr(facts, "SEEN", {})
    monkeypatch.setattr(facts, "SEEN_MAX", 2)
    arrays = [jax.device_put(np.ones(2), jax.devices("cpu")[0]) for _ in range(3)]
    arrays.append(sharded(np.ones((8, 2)), P("a")))
    placed = [facts.of(a.sharding) for a in arrays]
    assert len(facts.SEEN) <= 2
    assert [f.several for f in placed] == [False, False, False, True] and all(f.on_cpu for f in placed)
    assert facts.of(arrays[-1].sharding) is placed[-1]  # found again, by identity
    assert facts.SEEN[id(arrays[-1].sharding)][0] is arrays[-1].sharding
