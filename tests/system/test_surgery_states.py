"""A stateful test of model surgery on one checkpoint file, against a model of what it holds.

Hypothesis drives one file through random sequences of what `docs/concepts.md` ("Namespaces",
"Model surgery with namespaces") and `docs/cli.md` (`jckpt merge`) offer: a fresh save in a
namespace, appending saves that add a namespace or replace and add leaves in one (at another
alignment too), a load with `prefix_namespace` saved back beside the original, `jckpt.merge`
of another file (Python and command line), a file another writer made (OCANNL's path-less
entries) appended to, and appends that must be refused (a leaf where a node is, a node where a
leaf is, a bad namespace, a reserved or non-string metadata key), which leave the file's bytes
as they were. After every rule:

* `jckpt.load` gives exactly the model's `{namespace: tree}` (dtype, shape and bits), and
  `jckpt.restore` into a target of the model's structure gives the same values;
* the native reader (what `jckpt convert` writes out) gives the saved trees' empty nodes
  (`()`, `None`) back as `None` in their namespaces;
* `jckpt.verify` passes, `jckpt.describe` lists the model's entries, ids are unique in
  each namespace, and the user's metadata is the model's (an append's keys win, a merge keeps
  the output's).

The CI run is small; `JCKPT_STATES_SCALE=20` runs twenty times the examples.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import jckpt
import jckpt.adapters
from jckpt.format.names import RESERVED_PREFIX
from jckpt.tools import cli
from tests.helpers import raw_file
from tests.properties import STATES_SCALE, state_settings

STATS: collections.Counter = collections.Counter()
HOST = jckpt.Context(host=True, durable=False)
DTYPES = [np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.uint16), np.dtype(bool),
          np.dtype(ml_dtypes.bfloat16)]
KEYS = ["a", "b", "n1"]  # n1: the name `load` gives an OCANNL entry of id 1
NAMESPACES = ["jckpt", "teacher", "model", "ocannl"]  # OCANNL's: "model", "" (ocannl)
PREFIXES = ["p", "ema"]

Path = tuple[str, ...]


# --- the model: per namespace, leaves by key path, and the key paths of empty nodes ----------

def nested(leaves: dict[Path, object], empties: set[Path] = frozenset()) -> dict | None:
    """`{path: leaf}` (and empty nodes, as None) as nested dicts (None: the root is empty)."""
    if () in empties and not leaves:
        return None
    empties = {p for p in empties if not any(q[:len(p)] == p for q in leaves)}  # filled since
    tree: dict = {}
    for path, value in [*leaves.items(), *((p, None) for p in empties)]:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def filled(empties: set[Path], paths, new: tuple[Path, ...] = ()) -> set[Path]:
    """The empty nodes that an append of `paths` (leaves or nodes, `new` empty ones among them)
    leaves empty: those above none of them and below no new one."""
    return {p for p in empties if not any(q[:len(p)] == p for q in paths)
            and not any(p[:len(q)] == q for q in new)}


def unfilled(empties: set[Path]) -> set[Path]:
    """The empty nodes of a merge's inputs that none of the others lies under."""
    return {p for p in empties if not any(q != p and q[:len(p)] == p for q in empties)}


def one_tree(paths) -> bool:
    """Whether no path is a proper prefix of another (no leaf where another has a node)."""
    paths = sorted(set(paths))
    return not any(b[:len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(paths))


def one_tree_of(leaves: dict[Path, object]) -> dict[Path, object]:
    """`leaves` less those under another leaf, so that they form one tree."""
    return {p: v for p, v in leaves.items() if not any(q != p and p[:len(q)] == q for q in leaves)}


def array_for(seed: int, dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(0, 4, int(rng.integers(0, 3))))
    raw = rng.integers(0, 256, int(np.prod(shape, dtype=int)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.dtype(bool):
        raw = raw & 1
    return np.frombuffer(raw.tobytes(), dtype=dtype).reshape(shape)


paths = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3).map(tuple)
leaf_sets = st.dictionaries(paths, st.tuples(st.integers(0, 2**16), st.sampled_from(DTYPES)),
                            min_size=1, max_size=4).map(
    lambda d: {p: array_for(s, t) for p, (s, t) in d.items()})
metadatas = st.dictionaries(st.sampled_from(["run", "step", "note"]), st.text("xyz", max_size=3),
                            max_size=2)


def ocannl_file(seed: int) -> tuple[bytes, dict[str, dict[Path, np.ndarray]]]:
    """A file as OCANNL writes it (path-less entries, alignment 16, namespaces `""` and `model`)
    and what `load` gives of it."""
    data, entries, model = bytearray(), [], {}
    for ident in range(3):
        values = array_for(seed + ident, np.dtype(np.float32))
        offset = -(-len(data) // 16) * 16
        data.extend(b"\0" * (offset - len(data)) + values.tobytes())
        ns = "model" if ident % 2 else '""'
        dims = " ".join(map(str, values.shape))
        entries.append(f"((id {ident}) (namespace {ns}) (label (t {ident})) (prec Single_prec) "
                       f"(dims ({dims})) (padding none) (offset {offset}) "
                       f"(byte_length {values.nbytes}))")
        model.setdefault("model" if ident % 2 else "ocannl", {})[(f"n{ident}",)] = values
    text = f"((version 1) (alignment 16) (tensors ({' '.join(entries)})))"
    return raw_file(text, bytes(data), align=16), model


class SurgeryMachine(RuleBasedStateMachine):
    """One checkpoint file and the model of what it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(dir=ROOT)
        self.path = os.path.join(self.dir, "m.jckpt")
        self.leaves: dict[str, dict[Path, np.ndarray]] = {}
        self.empties: dict[str, set[Path]] = {}
        self.metadata: dict[str, str] = {}
        self.pathless: dict[str, set[Path]] = {}  # OCANNL's entries: a same-named leaf is refused
        self.alignment = 32  # the file's, as its last writer laid it out
        self.foreign = False  # another writer's file, not rewritten since: no checksums
        self.files = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def other(self) -> str:
        self.files += 1
        return os.path.join(self.dir, f"other{self.files}.jckpt")

    def refused(self, error, call, *, named: bool = True) -> None:
        """`call` raises `error` (naming the file) and leaves the file's bytes as they were."""
        before = open(self.path, "rb").read()
        with pytest.raises(error) as info:
            call()
        assert info.value.file or not named, info.value
        assert open(self.path, "rb").read() == before

    # --- rules ---------------------------------------------------------------------------------

    @initialize(ns=st.sampled_from(NAMESPACES), leaves=leaf_sets, empty=st.sampled_from(
        [None, (), {}, [], optax.EmptyState()]), metadata=metadatas)
    def fresh(self, ns, leaves, empty, metadata):
        self.save_fresh(ns, one_tree_of(leaves), empty, metadata)

    @rule(ns=st.sampled_from(NAMESPACES), leaves=leaf_sets,
          empty=st.sampled_from([None, (), optax.EmptyState()]), metadata=metadatas)
    def save_fresh(self, ns, leaves, empty, metadata):
        STATS["fresh"] += 1
        if not one_tree(leaves):
            return
        tree = nested(leaves)
        empties = set()
        if "e" not in tree:
            tree["e"] = empty
            empties = {("e",)}
        jckpt.save(HOST.replace(namespace=ns), tree, self.path, metadata=metadata)
        self.leaves, self.empties, self.metadata = {ns: dict(leaves)}, {ns: empties}, dict(metadata)
        self.pathless, self.alignment, self.foreign = {}, 32, False

    @rule(ns=st.sampled_from(NAMESPACES), leaves=leaf_sets, metadata=metadatas,
          alignment=st.sampled_from([None, 1, 16, 64, 4096]), empty=st.booleans())
    def append(self, ns, leaves, metadata, alignment, empty):
        STATS["append"] += 1
        if not one_tree(leaves):
            return
        kept = {p: v for p, v in self.leaves.get(ns, {}).items() if p not in leaves}
        tree = nested(leaves)
        new_empty = ("z",) if empty and not any(p[0] == "z" for p in kept) else None
        if new_empty:
            tree["z"] = ()
        call = lambda: jckpt.save(HOST.replace(namespace=ns), tree, self.path,
                                  appending=True, alignment=alignment, metadata=metadata)
        if not one_tree([*kept, *leaves]) or set(leaves) & self.pathless.get(ns, set()):
            STATS["append refused"] += 1
            self.refused(jckpt.InputError, call)
            return
        call()
        new = [new_empty] if new_empty else []
        self.empties[ns] = filled(self.empties.get(ns, set()), [*leaves, *new], tuple(new)) | set(new)
        self.leaves[ns] = {**kept, **leaves}
        self.metadata.update(metadata)
        self.alignment, self.foreign = alignment or 32, False

    @rule(ns=st.sampled_from(NAMESPACES), root=st.booleans(), prefix=st.sampled_from([None, "p"]))
    def append_empty_only(self, ns, root, prefix):
        """Append (or merge in) a namespace of empty nodes alone (`optax.sgd`'s state)."""
        STATS["empty only"] += 1
        target = f"{prefix}__{ns}" if prefix else ns
        if self.leaves.get(target) or self.pathless.get(target):
            return  # an empty node beside stored leaves: not what this rule is about
        if prefix:
            other = self.other()
            jckpt.save(HOST.replace(namespace=ns), optax.EmptyState() if root else {"z": ()}, other)
            jckpt.merge(self.path, [other], [prefix], append=True, durable=False)
        else:
            jckpt.save(HOST.replace(namespace=ns), optax.EmptyState() if root else {"z": ()},
                       self.path, appending=True)
        new = () if root else ("z",)
        if prefix:  # a merge: every node of either file, those holding another no longer empty
            self.empties[target] = unfilled({*self.empties.get(target, set()), new})
        else:  # an append: the new tree's nodes, and the old ones it does not fill
            self.empties[target] = filled(self.empties.get(target, set()), [new], (new,)) | {new}
        self.leaves.setdefault(target, {})
        self.alignment, self.foreign = 32, False

    @rule(prefix=st.sampled_from(PREFIXES), how=st.sampled_from(["python", "cli"]))
    @precondition(lambda self: all(len(ns) < 30 for ns in self.leaves))
    def merge_into_itself(self, prefix, how):
        """Merge the file into itself under a prefix: a copy of every namespace beside it."""
        STATS["self merge"] += 1
        renamed = {f"{prefix}__{ns}": ns for ns in {*self.leaves, *self.empties}
                   if self.leaves.get(ns) or self.empties.get(ns)}
        if how == "python":
            call = lambda: jckpt.merge(self.path, [self.path], [prefix], append=True,
                                       durable=False)
        else:
            call = lambda: cli.main(["merge", self.path, self.path, "--prefix", prefix,
                                     "--append"]) and pytest.fail("exit status")
        def held(ns):
            return {*self.leaves.get(ns, {}), *self.pathless.get(ns, set())}

        if any(held(new) & held(old) or not one_tree(held(new) | held(old))
               for new, old in renamed.items()):
            STATS["self merge refused"] += 1
            before = open(self.path, "rb").read()
            with pytest.raises((jckpt.ClashError, jckpt.InputError, pytest.fail.Exception)):
                call()
            assert open(self.path, "rb").read() == before
            return
        call()
        leaves, empties, pathless = dict(self.leaves), dict(self.empties), dict(self.pathless)
        for new, old in renamed.items():  # the file as it was merges in: `p__p__x` is the old `p__x`
            self.leaves[new] = {**leaves.get(new, {}), **leaves.get(old, {})}
            self.empties[new] = unfilled({*empties.get(new, set()), *empties.get(old, set())})
            self.pathless[new] = {*pathless.get(new, set()), *pathless.get(old, set())}
        self.alignment, self.foreign = 32, False

    @rule(ns=st.sampled_from(["bad-name", "", "1x", "a b"]))
    def append_bad_namespace(self, ns):
        STATS["bad namespace"] += 1
        self.refused(jckpt.InputError, lambda: jckpt.save(  # the context refuses it: no file yet
            HOST.replace(namespace=ns), {"a": np.ones(2)}, self.path, appending=True), named=False)

    @rule(key=st.sampled_from([RESERVED_PREFIX + "step", RESERVED_PREFIX + "empty_nodes", "n"]))
    def append_bad_metadata(self, key):
        STATS["bad metadata"] += 1
        value = 3 if key == "n" else "x"
        self.refused(jckpt.InputError, lambda: jckpt.save(
            HOST, {"a": np.ones(2)}, self.path, appending=True, metadata={key: value}))

    @rule(prefix=st.sampled_from(PREFIXES))
    @precondition(lambda self: all(len(ns) < 30 for ns in self.leaves))
    def rename_beside(self, prefix):
        """Load with a prefix and save every namespace back into the file, beside the originals."""
        STATS["rename"] += 1
        ctx, tree = jckpt.load(HOST, self.path, prefix_namespace=prefix)
        assert sorted(tree) == sorted(f"{prefix}__{ns}" for ns, leaves in self.leaves.items() if leaves)
        before = dict(self.leaves)  # what was loaded: `p__p__x` is the old `p__x`, not the new
        for ns, sub in tree.items():
            kept = self.leaves.get(ns, {})
            renamed = before[ns.split("__", 1)[1]]
            call = lambda ns=ns, sub=sub: jckpt.save(
                ctx.replace(namespace=ns), sub, self.path, appending=True)
            if not one_tree([*renamed, *(p for p in kept if p not in renamed)]) or \
                    set(renamed) & self.pathless.get(ns, set()):
                self.refused(jckpt.InputError, call)
                continue
            call()
            self.leaves[ns] = {**kept, **renamed}
            self.alignment, self.foreign = 32, False
            self.empties[ns] = filled(self.empties.get(ns, set()), renamed)

    @rule(ns=st.sampled_from(NAMESPACES), leaves=leaf_sets, empty=st.booleans(),
          prefix=st.sampled_from([None, *PREFIXES]), metadata=metadatas,
          how=st.sampled_from(["python", "cli", "cli-overwrite"]))
    def merge(self, ns, leaves, empty, prefix, metadata, how):
        """Merge another file into this one (appending to it, or rewriting it whole)."""
        STATS["merge"] += 1
        if not one_tree(leaves):
            return
        other = self.other()
        tree = nested(leaves)
        if empty and "e" not in tree:
            tree["e"] = None
        jckpt.save(HOST.replace(namespace=ns), tree, other, metadata=metadata)
        target = f"{prefix}__{ns}" if prefix else ns
        kept = self.leaves.get(target, {})
        if how == "python":
            call = lambda: jckpt.merge(self.path, [other], [prefix], append=True,
                                       durable=False)
        else:
            out = self.path if how == "cli" else self.other()
            args = ["merge", out, *([] if how == "cli" else [self.path]), other]
            args += ["--prefix", prefix or ""] if how == "cli" else ["--prefix", "", "--prefix",
                                                                      prefix or ""]
            args += ["--append"] if how == "cli" else []

            def call():
                code = cli.main(args)
                if code:
                    raise jckpt.InputError(f"exit {code}", file=out)
                if out != self.path:
                    os.replace(out, self.path)
        if set(leaves) & self.pathless.get(target, set()):
            STATS["merge refused"] += 1
            self.refused(jckpt.InputError, call)
            return
        if set(kept) & set(leaves):
            STATS["merge clash"] += 1
            self.refused(jckpt.ClashError if how == "python" else jckpt.InputError, call)
            return
        if not one_tree([*kept, *leaves]):
            STATS["merge refused"] += 1
            self.refused(jckpt.InputError, call)
            return
        call()
        self.leaves[target] = {**kept, **leaves}
        if empty and "e" not in nested(leaves):
            self.empties.setdefault(target, set()).add(("e",))
        self.metadata = {**metadata, **self.metadata}
        self.alignment, self.foreign = 32, False

    @rule(seed=st.integers(0, 100))
    def become_ocannl(self, seed):
        """Another writer's file replaces this one."""
        STATS["ocannl"] += 1
        raw, model = ocannl_file(seed)
        with open(self.path, "wb") as f:
            f.write(raw)
        self.leaves, self.empties, self.metadata = model, {}, {}
        self.pathless = {ns: set(leaves) for ns, leaves in model.items()}
        self.alignment, self.foreign = 16, True

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def loads_as_the_model(self):
        _, tree = jckpt.load(HOST, self.path)
        expected = {ns: nested(leaves) for ns, leaves in self.leaves.items() if leaves}
        assert_same(tree, expected)
        for ns, leaves in self.leaves.items():
            target = nested({p: np.zeros(v.shape, v.dtype) for p, v in leaves.items()})
            got = jckpt.restore(HOST.replace(namespace=ns), target, self.path)
            assert_same(got, nested(leaves), ns)

    @invariant()
    def reads_with_empty_nodes(self):
        read = jckpt.adapters.read(self.path)
        expected = {ns: nested(self.leaves.get(ns, {}), self.empties.get(ns, set()))
                    for ns in {*self.leaves, *(n for n, e in self.empties.items() if e)}}
        assert_same(read, expected)

    @invariant()
    def describes_the_model(self):
        header = jckpt.describe(self.path)
        names = collections.Counter((e.namespace or "ocannl") for e in header.tensors)
        assert names == collections.Counter({ns: len(v) for ns, v in self.leaves.items() if v})
        ids = [(e.namespace, e.id) for e in header.tensors]
        assert len(ids) == len(set(ids)), ids
        user = {k: v for k, v in header.metadata_dict().items() if not k.startswith(RESERVED_PREFIX)}
        assert user == self.metadata
        report = jckpt.verify(self.path)
        assert report.ok, report
        assert header.alignment == self.alignment
        assert self.foreign or not report.warnings, report  # laid out as jckpt lays out


def assert_same(got, expected, where="") -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), (where, got, expected)
        for k in expected:
            assert_same(got[k], expected[k], f"{where}/{k}")
    elif expected is None:
        assert got is None, (where, got)
    else:
        got = np.asarray(got)
        assert got.dtype == expected.dtype and got.shape == expected.shape, (where, got, expected)
        assert got.tobytes() == expected.tobytes(), (where, got, expected)


ROOT = tempfile.gettempdir()


def run(tmp_path, examples: int, steps: int) -> None:
    global ROOT
    ROOT = str(tmp_path)
    run_state_machine_as_test(SurgeryMachine, settings=state_settings(examples, steps))
    print(f"SurgeryMachine: {examples * STATES_SCALE} examples, {dict(STATS)}")


def test_surgery_states(tmp_path):
    run(tmp_path, examples=40, steps=15)
