"""Old module paths keep importing, with a DeprecationWarning, and give the very same objects."""

import importlib
import subprocess
import sys

import pytest

import jckpt


def fresh_import(monkeypatch, name: str):
    """Import ``name`` as if for the first time in this process (the warning fires once)."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent, _, child = name.rpartition(".")
    monkeypatch.delattr(sys.modules[parent], child, raising=False)
    return importlib.import_module(name)


def test_a_module_moved_whole_is_its_new_home(monkeypatch):
    with pytest.warns(DeprecationWarning, match="jckpt.tree moved to jckpt.trees.pytree"):
        old = fresh_import(monkeypatch, "jckpt.tree")
    assert old is importlib.import_module("jckpt.trees.pytree")


def test_a_split_module_finds_what_moved_out_of_it(monkeypatch):
    from jckpt.services import engine, mirror
    from jckpt.trees import facts, transfers

    with pytest.warns(DeprecationWarning, match="jckpt.sharding moved to jckpt.trees.sharding"):
        old = fresh_import(monkeypatch, "jckpt.sharding")
    assert old.record_reads is jckpt.trees.sharding.record_reads
    assert old.is_sharded is facts.is_sharded
    assert old.await_host is transfers.await_host
    with pytest.warns(DeprecationWarning, match="jckpt.mirror moved to jckpt.services.mirror"):
        old = fresh_import(monkeypatch, "jckpt.mirror")
    assert old.Mirror is mirror.Mirror and old.MirrorCounters is engine.MirrorCounters


def test_the_split_distributed_module_finds_each_name_in_its_new_home(monkeypatch):
    from jckpt.api import multiprocess
    from jckpt.format import index, names
    from jckpt.storage import directory
    from jckpt.storage.checkpoint import open_checkpoint

    with pytest.warns(DeprecationWarning, match="jckpt.distributed moved to jckpt.tools.consolidate"):
        old = fresh_import(monkeypatch, "jckpt.distributed")
    assert old.consolidate is jckpt.consolidate
    assert old.DistributedError is jckpt.DistributedError is jckpt.errors.DistributedError
    assert old.save_directory is multiprocess.save_directory
    assert old.barrier_timeout is multiprocess.barrier_timeout
    assert old.DirectoryReader is directory.DirectoryReader
    assert old.open_checkpoint is open_checkpoint
    assert old.publish_directory is directory.publish_directory
    assert old.reclaim_stage_dirs is directory.reclaim_stage_dirs
    assert old.write_index is directory.write_index
    assert old.parse_index is index.parse_index
    assert old.index_header is index.index_header
    assert (old.INDEX_NAME, old.PIECE_RE, old.piece_name) == (names.INDEX_NAME, names.PIECE_RE,
                                                               names.piece_name)
    assert {"consolidate", "save_directory", "DirectoryReader"} <= set(dir(old))
    with pytest.raises(AttributeError, match="no attribute 'ArrayInfo'"):
        _ = old.ArrayInfo  # the index's record is IndexedArray now (jckpt.format.index)
    assert not hasattr(old, "__path__")  # a module, not a package


def test_from_old_distributed_import_warns_and_stays_jax_free():
    code = ("import sys, warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    from jckpt.distributed import consolidate, DirectoryReader, INDEX_NAME\n"
            "import jckpt\n"
            "assert consolidate is jckpt.consolidate and INDEX_NAME == 'index.jckpt'\n"
            "assert any(issubclass(w.category, DeprecationWarning) and 'jckpt.distributed' in\n"
            "           str(w.message) for w in caught), [str(w.message) for w in caught]\n"
            "print('jax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sharding_still_offers_what_moved_out_of_it():
    from jckpt.format import boxes
    from jckpt.storage import lazy, regions
    from jckpt.trees import sharding

    assert sharding.ShardedSource is regions.ShardedSource
    assert sharding.LazyArray is lazy.LazyArray
    assert sharding.record_reads is lazy.record_reads
    assert sharding.box_of is boxes.box_of and sharding.check_tiling is boxes.check_tiling
