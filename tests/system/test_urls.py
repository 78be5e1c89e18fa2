"""URLs at every entry point: served by the object store backend, or refused with one clear InputError.

A URL must never be taken for a relative local path: that would silently
create a file or a directory called ``ftp:`` in the working directory. A URL
of a scheme jckpt stores to (``s3://``, ``gs://``, ``az://``, ``memory://``)
goes to the object store backend; any other scheme is refused before anything
is created. Every test runs in an empty working directory and checks that its
listing did not change. The rule for what counts as a URL is
``jckpt.storage.backend.backend_for``'s; the last tests pin it down.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jckpt
from jckpt import adapters
from jckpt.adapters import numpy as npy_adapter
from jckpt.adapters import orbax as orbax_adapter
from jckpt.adapters import orbax_writer
from jckpt.adapters import safetensors as st_adapter
from jckpt.api.multiprocess import save_directory
from jckpt.storage import LOCAL, backend_for
from jckpt.storage.backend import url_scheme
from jckpt.storage.object_backend import OBJECT_STORE
from jckpt.tools import classify, rewrite
from jckpt.tools.cli import EXIT_ERROR, main
from jckpt.tools.diff import diff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URLS = {"ftp://bucket/x": "ftp", "hdfs://b/x": "hdfs", "file:///x": "file"}
TREE = {"w": np.arange(3, dtype=np.float32)}


@pytest.fixture(params=sorted(URLS))
def url(request):
    return request.param


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty working directory; a test adds its local inputs, then calls ``here.freeze()``."""
    monkeypatch.chdir(tmp_path)

    class Here:
        before: list[str] | None = None

        def freeze(self):
            self.before = sorted(os.listdir(tmp_path))

    state = Here()
    yield state
    before = state.before if state.before is not None else []
    assert sorted(os.listdir(tmp_path)) == before, "something was created in the working directory"


def refused(url, call, *args, **kwargs):
    """``call(*args)`` raises the InputError naming ``url``'s scheme and what is supported."""
    with pytest.raises(jckpt.InputError) as info:
        call(*args, **kwargs)
    e = info.value
    assert e.message == f"no storage backend for URL scheme {URLS[url]!r}"
    assert e.file == url
    assert "local filesystem path" in e.fix and "s3://" in e.fix and "gs://" in e.fix
    return e


def local_file(name="a.jckpt"):
    jckpt.save(jckpt.Context(), TREE, name)
    return name


# --- the Python API --------------------------------------------------------------------------

def test_save_load_restore_describe(here, url):
    here.freeze()
    refused(url, jckpt.save, jckpt.Context(), TREE, url)
    refused(url, jckpt.save, jckpt.Context(), TREE, url, appending=True)
    refused(url, jckpt.load, jckpt.Context(), url)
    refused(url, jckpt.restore, jckpt.Context(), TREE, url)
    refused(url, jckpt.describe, url)


def test_mirror(here, url):
    here.freeze()
    refused(url, jckpt.Mirror, url)
    refused(url, jckpt.Mirror, url, new_lineage=True)


def test_checkpoint_manager(here, url):
    here.freeze()
    refused(url, jckpt.CheckpointManager, url)
    refused(url, jckpt.CheckpointManager, url, keep_last=2, directory_steps=True)


def test_convert_either_side(here, url):
    src = local_file()
    np.savez("w.npz", w=np.zeros(2))
    here.freeze()
    refused(url, jckpt.convert, url, "b.jckpt")
    refused(url, jckpt.convert, url, "b.safetensors")
    for dst in (url, url + ".safetensors", url + ".npz", url + ".npy", url + ".pt"):
        with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme"):
            jckpt.convert(src, dst)
        with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme"):
            jckpt.convert("w.npz", dst)
    refused(url, jckpt.convert, src, url, format="orbax")
    refused(url, jckpt.convert, src, url, format="safetensors")


def test_detect_format_read_write(here, url):
    here.freeze()
    refused(url, jckpt.detect_format, url)
    refused(url, adapters.read, url)
    for fmt in ("npz", "safetensors", "orbax", "torch", "llmc", "jckpt"):
        refused(url, adapters.read, url, format=fmt)
    for fmt in ("npz", "npy", "safetensors", "orbax", "torch", "jckpt", "ocannl"):
        refused(url, adapters.write, {"jckpt": TREE}, url, format=fmt)


def test_adapters_read_and_publish_through_the_backend(here, url):
    """The adapters' own readers and writers reach storage through backend_for too."""
    here.freeze()
    refused(url, st_adapter.read, url)
    refused(url, npy_adapter.read_npz, url)
    refused(url, npy_adapter.write_npz, {"jckpt": TREE}, url)
    refused(url, st_adapter.write, {"jckpt": TREE}, url)
    refused(url, orbax_adapter.read, url)
    refused(url, orbax_writer.write, {"jckpt": TREE}, url)


def test_tools(here, url):
    a = local_file()
    save_directory(jckpt.Context(), TREE, "d")
    here.freeze()
    refused(url, jckpt.info, url)
    refused(url, jckpt.verify, url)
    refused(url, classify.classify, url)
    refused(url, diff, url, a)
    refused(url, diff, a, url)
    refused(url, rewrite.merge, url, [a])
    refused(url, rewrite.merge, "out.jckpt", [a, url])
    refused(url, rewrite.merge, url, [a], append=True)
    refused(url, rewrite.relayout, url, "out.jckpt")
    refused(url, rewrite.relayout, a, url)
    refused(url, jckpt.consolidate, url, "one.jckpt")
    refused(url, jckpt.consolidate, "d", url)


def test_a_url_made_into_a_path_is_still_a_url(here):
    """``pathlib.Path('ftp://b/x')`` collapses the slashes to ``ftp:/b/x``: still not a local path."""
    here.freeze()
    path = pathlib.Path("ftp://bucket/x")
    assert str(path) == "ftp:/bucket/x"
    with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme 'ftp'"):
        jckpt.save(jckpt.Context(), TREE, path)
    with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme 'ftp'"):
        jckpt.CheckpointManager(path)
    with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme 'ftp'"):
        jckpt.Mirror(path)
    pytest.importorskip("obstore")
    jckpt.save(jckpt.Context(), TREE, pathlib.Path("memory://paths/x.jckpt"))
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(), "memory:/paths/x.jckpt")[1]["jckpt"]["w"],
                                  TREE["w"])


def test_supported_urls_create_nothing_locally(here):
    """Saving to and reading from a served URL touches the store only, never the working directory."""
    pytest.importorskip("obstore")
    src = local_file()
    here.freeze()
    url = "memory://here/run/a.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    jckpt.restore(jckpt.Context(), TREE, url)
    jckpt.convert(src, "memory://here/run/b.safetensors")
    assert jckpt.verify(url).ok
    assert classify.classify("memory://here/run").name == "unknown"
    assert classify.classify("memory://here/nothing").name == "missing"


# --- the command line --------------------------------------------------------------------------

@pytest.fixture
def cli(capsys):
    def run(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return run


def test_cli(here, url, cli):
    a = local_file()
    here.freeze()
    for args in (["inspect", url], ["inspect", "--json", url], ["verify", url], ["diff", url, a],
                 ["diff", a, url], ["convert", url, "b.jckpt"], ["convert", a, url],
                 ["convert", a, url + ".safetensors"], ["convert", a, url, "--format", "orbax"],
                 ["merge", url, a], ["merge", "out.jckpt", a, url]):
        rc, out, err = cli(*args)
        assert rc == EXIT_ERROR, args
        assert out == "", args
        assert f"no storage backend for URL scheme {URLS[url]!r}" in err, args
        assert "local filesystem path" in err, args
        assert url in err, args


def test_cli_process(here):
    """As a command: exit status 2, one line naming the URL and the scheme, nothing created."""
    here.freeze()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "jckpt", "convert", "a.npz", "ftp://bucket/x"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("jckpt: error: ftp://bucket/x: no storage backend for URL "
                                  "scheme 'ftp' (fix: ")
    assert done.stderr.count("\n") == 1


# --- what counts as a URL ----------------------------------------------------------------------

@pytest.mark.parametrize("path, scheme", [
    ("s3://bucket/x", "s3"), ("gs://b/x", "gs"), ("memory://x", "memory"), ("S3://B/x", "s3"),
    ("az://c/x", "az"), ("s3:/bucket/x", "s3"), (b"s3://bucket/x", "s3"),
    (pathlib.PurePosixPath("gs://b/x"), "gs"),
])
def test_served_urls(path, scheme):
    pytest.importorskip("obstore")
    assert url_scheme(path) == scheme
    assert backend_for(path) is OBJECT_STORE


@pytest.mark.parametrize("path, scheme", [
    ("file:///tmp/x", "file"), ("git+ssh://host/x", "git+ssh"), ("ftp:/host/x", "ftp"),
    ("HTTP://host/x", "http"),
])
def test_refused_urls(path, scheme):
    assert url_scheme(path) == scheme
    with pytest.raises(jckpt.InputError) as info:
        backend_for(path)
    assert info.value.message == f"no storage backend for URL scheme {scheme!r}"


@pytest.mark.parametrize("path", [
    "C:/x", "C:\\x", "c://x", "dir/a://b", "./s3://b", "/abs/s3://b", " s3://b", "s3:b",
    "run:1/ckpt", "2024-01-01T10:00/ckpt", "1s://x", "model.jckpt", "", "s3", "-s3://x",
])
def test_local_paths(path):
    assert url_scheme(path) is None
    assert backend_for(path) is LOCAL


@pytest.mark.parametrize("path", ["C:/x.jckpt", "dir/a://b.jckpt"])
def test_local_paths_that_look_odd_still_work(tmp_path, monkeypatch, path):
    """A drive-like or ``://``-inside name is an ordinary relative path: saved and read back."""
    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    jckpt.save(jckpt.Context(), TREE, path)
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(), path)[1]["jckpt"]["w"], TREE["w"])
    assert jckpt.detect_format(path) == "jckpt"
    assert jckpt.verify(path).ok
    assert os.path.isfile(os.path.normpath(path))
