/* Decoding and encoding of the canonical tensors list: the entries exactly as jckpt writes them.
 *
 * This is an optional accelerator for jckpt.format.fastpath.canonical_entries: it
 * accepts exactly the language of the regular expression _CANONICAL_ENTRY there and
 * builds the same Entry objects, so a header decodes identically with or without it.
 * Anything outside that language (quoted atoms, padding, unknown fields, integers of
 * more than 18 digits, an unknown prec, a byte_length that disagrees with the dims, a
 * piece's slice that does not fit its dims and global_dims) returns None, and the Python reader takes over with its full validation.
 *
 *   decode_entries(text: str, pos: int, entry_type: type, fields: tuple[str, ...],
 *                  precs: dict[str, tuple[str, int]], kinds: tuple[str, ...], max_path: int)
 *     -> tuple[list[Entry], int] | int | None
 *
 * A key path of more than max_path components returns None as soon as it is met (the
 * general reader refuses it: a crafted path of a component repeated a million times was
 * built in full first, 11 times the header's size).
 *
 * On success the int is the position of the ')' that closes the tensors list. An entry
 * whose text repeats the one before it verbatim (a duplicate identity, which every reader
 * refuses) stops the decoding there, before the entries after it are built: the result is
 * then its index alone.
 *
 * It also encodes: encode_entries writes exactly what jckpt.format.header_encoder's
 * _encode_entry writes for each entry, joined by "\n   ", and where each entry's checksum
 * digits start (counted from `base`). An entry it does not handle (not exactly of
 * entry_type, padding, extra fields, integers beyond 64 bits, fields that are not plain
 * str, int and tuple values, text written unquoted that is not ASCII) is encoded by
 * `fallback` (_encode_entry itself), so the text is the same either way.
 *
 *   encode_entries(entries: Sequence[Entry], entry_type: type, fields: tuple[str, ...],
 *                  fallback: Callable[[Entry], tuple[str, int | None]], base: int)
 *     -> tuple[bytes, list[int | None]] | None
 *
 * The text comes as ASCII bytes, ready for the file; None when a fallback's text is not
 * ASCII (its character and byte offsets differ): the caller then encodes every entry.
 *
 * And it builds the entries of a save's small host leaves (jckpt.format.leaf_entries.build):
 *
 *   host_entries(namespace, paths: list, hosts: list, start, first_id, cursor, alignment,
 *                small_limit, max_path, precs: dict[dtype, tuple[str, int]], hasher, algorithm,
 *                entry_type, fields, source_type, uint8, entries: list, sources: list)
 *     -> tuple[int, int]
 *
 * From hosts[start] on, each leaf (dtype, shape, key_impl, array, ...) whose array is a
 * C-contiguous one of fewer than small_limit bytes, of a dtype in precs (native byte order),
 * with a path of at most max_path (kind, str | int) pairs, gets what saving's Python loop gives
 * it: the entry entry_for builds (id first_id, first_id + 1, ...; offset the cursor rounded up
 * to alignment) and source_type(array.reshape(-1).view(uint8), (algorithm, "%016x" of
 * hasher(data))), appended to entries and sources. It stops at the first other leaf and
 * returns its index (len(hosts) when none) and the cursor: Python builds that leaf.
 *
 * And it stages a save's plain leaves on the host (jckpt.trees.to_host.host_leaves):
 *
 *   stage_leaves(leaves: list, start, storable: set, shardings: dict, seen: dict, seen_max,
 *                jax_types: frozenset, host_leaf: type, asarray, out: list, ndarray: type) -> int
 *
 * From leaves[start] on, each (where, leaf) whose leaf is exactly a numpy ndarray, or of a type in
 * jax_types whose sharding's facts (shardings[sharding]: (on_cpu, several, whole, ...)) say one CPU
 * device of this process (seen caches the facts by the sharding's identity, at most seen_max
 * of them), with a dtype in
 * storable, is appended to out as
 * host_leaf(dtype, shape, None, array, (), False): array is the ndarray itself, or
 * asarray(leaf) (host memory already, no transfer), or the jax array itself when asarray is
 * None (a caller that copies it at once, from its buffer). It stops at the first other leaf and
 * returns its index (len(leaves) when none): Python stages that one.
 *
 * And it gathers a save's small payloads for one writev (jckpt.storage.writer.Sink.gather_run):
 *
 *   gather_payloads(entries: list, sources: list, start, base, position, source_type: type,
 *                   zeros: memoryview, pending: list, sums: list, max_buffers, max_bytes)
 *     -> tuple[int, int, int]
 *
 * From sources[start] on, each source of exactly source_type (a 2-tuple: (data, checksum))
 * whose data's len is its entry's byte_length, at base + entry.offset no earlier than the
 * position, appends to pending the zeros up to that offset (a slice of zeros) and the data,
 * and to sums the checksum. It stops at the first other source, or before pending would
 * hold more than max_buffers buffers or max_bytes bytes, and returns where it stopped, the
 * new position and the bytes it appended. *
 * And it maps a load's payloads (jckpt.storage.reader.CheckpointReader.decode_all):
 *
 *   map_payloads(buffer, entries: list, data_start, size, precs: dict[str, tuple[dtype, int]],
 *                frombuffer, out: list) -> int
 *
 * appends, for each entry, frombuffer(buffer, dtype, count, data_start + offset) shaped as its
 * dims (a zero-copy view of the mapping), as payload.decode_payload maps it, when the entry is
 * unpadded, of a prec in precs (dtype and its itemsize: the precs whose array shape is their
 * dims), element-aligned, non-empty, inside size bytes and as long as its dims say; else None
 * (Python decodes that one). Returns how many it mapped. *
 * And it copies a snapshot's host arrays into their slot's buffers
 * (jckpt.services.snapshot.copy_all):
 *
 *   copy_arrays(dsts: list, srcs: list) -> list[int]
 *
 * copies each srcs[i] into dsts[i] (memcpy, the GIL released for large ones) when both are
 * C-contiguous buffers of the same format (less a native byte-order prefix), itemsize and
 * shape, dsts[i] writable (a source may be any buffer: a jax array on the CPU too); returns
 * the indices of the pairs it left (Python copies those).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

typedef struct {
    const char *s;
    Py_ssize_t n;
    Py_ssize_t i;
} cursor;

/* printable ASCII except space ( ) " ; # | \ : the plain-atom characters */
static int is_atom_char(unsigned char c) {
    return c > 32 && c < 127 && c != '(' && c != ')' && c != '"' && c != ';' && c != '#' &&
           c != '|' && c != '\\';
}
static int is_word_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}
static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int lit(cursor *c, const char *text) {
    size_t k = strlen(text);
    if ((size_t)(c->n - c->i) < k || memcmp(c->s + c->i, text, k) != 0) return 0;
    c->i += (Py_ssize_t)k;
    return 1;
}

/* [0-9]+ of at most 18 digits (else fail: the Python reader handles big numbers) */
static int parse_uint(cursor *c, long long *out) {
    Py_ssize_t start = c->i;
    long long v = 0;
    while (c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9') {
        v = v * 10 + (c->s[c->i] - '0');
        c->i++;
        if (c->i - start > 18) return 0;
    }
    if (c->i == start) return 0;
    *out = v;
    return 1;
}

static Py_ssize_t run(cursor *c, int (*pred)(unsigned char)) {
    Py_ssize_t start = c->i;
    while (c->i < c->n && pred((unsigned char)c->s[c->i])) c->i++;
    return c->i - start;
}

static PyObject *str_at(cursor *c, Py_ssize_t start, PyObject *cache) {
    PyObject *s = PyUnicode_DecodeASCII(c->s + start, c->i - start, NULL);
    if (s == NULL || cache == NULL) return s;
    PyObject *known = PyDict_GetItemWithError(cache, s);
    if (known != NULL) {
        Py_DECREF(s);
        Py_INCREF(known);
        return known;
    }
    if (PyErr_Occurred() || PyDict_SetItem(cache, s, s) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return s;
}

/* Dims beyond this many make the entry non-canonical here (the Python reader checks the
 * format's own limit). */
#define MAX_DIMS 64

static PyObject *int_tuple(const long long *v, int n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *x = PyLong_FromLongLong(v[k]);
        if (x == NULL) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, k, x);
    }
    return t;
}

/* After " (slice (": "(A B) ...)) (global_dims (G ...))" of a piece whose dims are dimv, with
 * 0 <= A <= B <= G and B - A = dim in every dimension. Returns 1 and sets *slice and *global
 * (new references), 0 when the text is not that (or on a Python error: check PyErr_Occurred). */
static int parse_piece(cursor *c, const long long *dimv, int ndim, PyObject **slice,
                       PyObject **global) {
    long long lo[MAX_DIMS], hi[MAX_DIMS], g[MAX_DIMS];
    int n = 0, m = 0;
    if (c->i < c->n && c->s[c->i] != ')') {
        for (;;) {
            if (n == ndim || !lit(c, "(") || !parse_uint(c, &lo[n]) || !lit(c, " ") ||
                !parse_uint(c, &hi[n]) || !lit(c, ")"))
                return 0;
            n++;
            if (!lit(c, " ")) break;
        }
    }
    if (n != ndim || !lit(c, ")) (global_dims (")) return 0;
    if (c->i < c->n && c->s[c->i] != ')') {
        for (;;) {
            if (m == ndim || !parse_uint(c, &g[m])) return 0;
            m++;
            if (!lit(c, " ")) break;
        }
    }
    if (m != ndim || !lit(c, "))")) return 0;
    for (int k = 0; k < ndim; k++)
        if (lo[k] > hi[k] || hi[k] > g[k] || hi[k] - lo[k] != dimv[k]) return 0;
    PyObject *pairs = PyTuple_New(ndim);
    if (pairs == NULL) return 0;
    for (int k = 0; k < ndim; k++) {
        long long pair[2] = {lo[k], hi[k]};
        PyObject *t = int_tuple(pair, 2);
        if (t == NULL) { Py_DECREF(pairs); return 0; }
        PyTuple_SET_ITEM(pairs, k, t);
    }
    PyObject *gd = int_tuple(g, ndim);
    if (gd == NULL) { Py_DECREF(pairs); return 0; }
    *slice = pairs;
    *global = gd;
    return 1;
}

#define FAIL_IF(cond) do { if (cond) goto fallback; } while (0)
#define CHECK(obj) do { if ((obj) == NULL) goto error; } while (0)

/* The entry type's fields are __slots__: find each slot's offset in the object. */
static int slot_offsets(PyObject *entry_type, PyObject *fields, Py_ssize_t *offsets) {
    for (int k = 0; k < 14; k++) {
        PyObject *descr = PyObject_GetAttr(entry_type, PyTuple_GET_ITEM(fields, k));
        if (descr == NULL) return -1;
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok) offsets[k] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "the entry type must use __slots__");
            return -1;
        }
    }
    return 0;
}

static PyObject *decode_entries(PyObject *self, PyObject *args) {
    PyObject *text, *entry_type, *fields, *precs, *kinds;
    Py_ssize_t pos, max_path;
    if (!PyArg_ParseTuple(args, "UnOO!O!O!n", &text, &pos, &entry_type, &PyTuple_Type, &fields,
                          &PyDict_Type, &precs, &PyTuple_Type, &kinds, &max_path))
        return NULL;
    if (!PyType_Check(entry_type) || PyTuple_GET_SIZE(fields) != 14 ||
        PyTuple_GET_SIZE(kinds) != 5) {
        PyErr_SetString(PyExc_TypeError, "decode_entries: unexpected arguments");
        return NULL;
    }
    Py_ssize_t offsets[14];
    if (slot_offsets(entry_type, fields, offsets) < 0) return NULL;
    /* kinds: ('k', 'ki', 'i', 'a', 'f') */
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL) return NULL;
    if (pos < 0 || pos > n) Py_RETURN_NONE;
    cursor cur = {s, n, pos};
    cursor *c = &cur;

    PyObject *entries = PyList_New(0), *cache = PyDict_New(), *empty = PyTuple_New(0);
    PyObject *values[14] = {NULL};
    PyObject *items = NULL;
    Py_ssize_t last = 0, last_size = -1, repeated = -1;  /* the entry before, as text */
    if (entries == NULL || cache == NULL || empty == NULL) goto error;

    for (;;) {
        Py_ssize_t save = c->i;
        run(c, is_space);
        Py_ssize_t begin = c->i;
        if (!lit(c, "((id ")) { c->i = save; break; }
        long long ident, offset, byte_length, v;
        Py_ssize_t start;
        for (int k = 0; k < 14; k++) values[k] = NULL;

        FAIL_IF(!parse_uint(c, &ident) || !lit(c, ") (namespace "));
        start = c->i;
        FAIL_IF(c->i >= c->n || (s[c->i] >= '0' && s[c->i] <= '9') || !is_word_char((unsigned char)s[c->i]));
        run(c, is_word_char);
        CHECK(values[1] = str_at(c, start, cache));  /* namespace */
        FAIL_IF(!lit(c, ") (label ("));
        /* label: A( A)* or nothing */
        CHECK(items = PyList_New(0));
        if (c->i < c->n && s[c->i] != ')') {
            for (;;) {
                start = c->i;
                FAIL_IF(run(c, is_atom_char) == 0);
                PyObject *atom = str_at(c, start, cache);
                CHECK(atom);
                int rc = PyList_Append(items, atom);
                Py_DECREF(atom);
                CHECK(rc == 0 ? items : NULL);
                if (c->i < c->n && s[c->i] == ' ') { c->i++; continue; }
                break;
            }
        }
        CHECK(values[6] = PyList_AsTuple(items));  /* label */
        Py_CLEAR(items);
        FAIL_IF(!lit(c, ")) (prec "));
        start = c->i;
        FAIL_IF(run(c, is_word_char) == 0);
        PyObject *pname = PyUnicode_DecodeASCII(s + start, c->i - start, NULL);
        CHECK(pname);
        PyObject *prec = PyDict_GetItemWithError(precs, pname);
        Py_DECREF(pname);
        if (prec == NULL) { CHECK(PyErr_Occurred() ? NULL : entries); goto fallback; }
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(prec, 1));
        values[2] = PyTuple_GET_ITEM(prec, 0);
        Py_INCREF(values[2]);
        FAIL_IF(!lit(c, ") (dims ("));
        CHECK(items = PyList_New(0));
        long long count = 1;
        long long dimv[MAX_DIMS];
        int ndim = 0;
        if (c->i < c->n && s[c->i] != ')') {
            for (;;) {
                FAIL_IF(!parse_uint(c, &v));
                FAIL_IF(ndim == MAX_DIMS);
                dimv[ndim++] = v;
                FAIL_IF(__builtin_mul_overflow(count, v, &count));
                PyObject *d = PyLong_FromLongLong(v);
                CHECK(d);
                int rc = PyList_Append(items, d);
                Py_DECREF(d);
                CHECK(rc == 0 ? items : NULL);
                if (c->i < c->n && s[c->i] == ' ') { c->i++; continue; }
                break;
            }
        }
        CHECK(values[3] = PyList_AsTuple(items));  /* dims */
        Py_CLEAR(items);
        FAIL_IF(!lit(c, ")) (padding none) (offset "));
        FAIL_IF(!parse_uint(c, &offset) || !lit(c, ") (byte_length "));
        FAIL_IF(!parse_uint(c, &byte_length) || !lit(c, ")"));
        long long expected;
        FAIL_IF(__builtin_mul_overflow(count, size, &expected) || expected != byte_length);
        CHECK(values[0] = PyLong_FromLongLong(ident));
        CHECK(values[4] = PyLong_FromLongLong(offset));
        CHECK(values[5] = PyLong_FromLongLong(byte_length));
        values[7] = Py_None; Py_INCREF(Py_None);  /* padding */
        if (lit(c, " (path (")) {
            CHECK(items = PyList_New(0));
            if (c->i < c->n && s[c->i] != ')') {
                for (;;) {
                    FAIL_IF(PyList_GET_SIZE(items) >= max_path || !lit(c, "("));
                    PyObject *kind, *value;
                    int numeric;
                    if (lit(c, "k ")) { kind = PyTuple_GET_ITEM(kinds, 0); numeric = 0; }
                    else if (lit(c, "ki ")) { kind = PyTuple_GET_ITEM(kinds, 1); numeric = 1; }
                    else if (lit(c, "i ")) { kind = PyTuple_GET_ITEM(kinds, 2); numeric = 1; }
                    else if (lit(c, "a ")) { kind = PyTuple_GET_ITEM(kinds, 3); numeric = 0; }
                    else if (lit(c, "f ")) { kind = PyTuple_GET_ITEM(kinds, 4); numeric = 1; }
                    else goto fallback;
                    if (numeric) {
                        int neg = lit(c, "-");
                        FAIL_IF(!parse_uint(c, &v));
                        CHECK(value = PyLong_FromLongLong(neg ? -v : v));
                    } else {
                        start = c->i;
                        FAIL_IF(run(c, is_atom_char) == 0);
                        CHECK(value = str_at(c, start, cache));
                    }
                    PyObject *pair = PyTuple_Pack(2, kind, value);
                    Py_DECREF(value);
                    CHECK(pair);
                    int rc = PyList_Append(items, pair);
                    Py_DECREF(pair);
                    CHECK(rc == 0 ? items : NULL);
                    FAIL_IF(!lit(c, ")"));
                    if (c->i < c->n && s[c->i] == ' ') { c->i++; continue; }
                    break;
                }
            }
            CHECK(values[8] = PyList_AsTuple(items));
            Py_CLEAR(items);
            FAIL_IF(!lit(c, "))"));
        } else {
            values[8] = Py_None; Py_INCREF(Py_None);
        }
        if (lit(c, " (checksum (")) {
            start = c->i;
            FAIL_IF(run(c, is_word_char) == 0);
            PyObject *algo = str_at(c, start, cache);
            CHECK(algo);
            if (!lit(c, " ")) { Py_DECREF(algo); goto fallback; }
            start = c->i;
            while (c->i < c->n && ((s[c->i] >= '0' && s[c->i] <= '9') ||
                                   (s[c->i] >= 'a' && s[c->i] <= 'f'))) c->i++;
            if (c->i == start || !lit(c, "))")) { Py_DECREF(algo); goto fallback; }
            PyObject *digest = PyUnicode_DecodeASCII(s + start, c->i - start - 2, NULL);
            if (digest == NULL) { Py_DECREF(algo); goto error; }
            values[9] = PyTuple_Pack(2, algo, digest);
            Py_DECREF(algo);
            Py_DECREF(digest);
            CHECK(values[9]);
        } else {
            values[9] = Py_None; Py_INCREF(Py_None);
        }
        if (lit(c, " (key_impl ")) {
            start = c->i;
            FAIL_IF(run(c, is_word_char) == 0);
            CHECK(values[10] = str_at(c, start, cache));
            FAIL_IF(!lit(c, ")"));
        } else {
            values[10] = Py_None; Py_INCREF(Py_None);
        }
        if (lit(c, " (slice (")) {
            FAIL_IF(!parse_piece(c, dimv, ndim, &values[11], &values[12]));
        } else {
            values[11] = Py_None; Py_INCREF(Py_None);  /* slice */
            values[12] = Py_None; Py_INCREF(Py_None);  /* global_dims */
        }
        FAIL_IF(!lit(c, ")"));
        if (c->i - begin == last_size && memcmp(s + begin, s + last, last_size) == 0) {
            repeated = PyList_GET_SIZE(entries);  /* a duplicate identity, refused at once */
            goto fallback;
        }
        last = begin;
        last_size = c->i - begin;
        values[13] = empty; Py_INCREF(empty);      /* extra */

        PyTypeObject *tp = (PyTypeObject *)entry_type;
        PyObject *obj = tp->tp_alloc(tp, 0);
        CHECK(obj);
        for (int k = 0; k < 14; k++) {  /* the slots take over the references */
            *(PyObject **)((char *)obj + offsets[k]) = values[k];
            values[k] = NULL;
        }
        if (PyList_Append(entries, obj) < 0) { Py_DECREF(obj); goto error; }
        Py_DECREF(obj);
    }
    run(c, is_space);
    if (c->i >= c->n || s[c->i] != ')') goto fallback;
    Py_DECREF(cache);
    Py_DECREF(empty);
    return Py_BuildValue("(Nn)", entries, c->i);

fallback:
    if (PyErr_Occurred()) goto error;
    for (int k = 0; k < 14; k++) Py_CLEAR(values[k]);
    Py_XDECREF(items);
    Py_XDECREF(entries);
    Py_XDECREF(cache);
    Py_XDECREF(empty);
    if (repeated >= 0) return PyLong_FromSsize_t(repeated);
    Py_RETURN_NONE;
error:
    for (int k = 0; k < 14; k++) Py_CLEAR(values[k]);
    Py_XDECREF(items);
    Py_XDECREF(entries);
    Py_XDECREF(cache);
    Py_XDECREF(empty);
    return NULL;
}

/* --- encoding ------------------------------------------------------------------------------ */

/* The text being written: a bytes object grown in place (it is ASCII, so bytes and
 * characters agree), and how much of it is written. */
typedef struct {
    PyObject *bytes;
    char *p;
    Py_ssize_t n, cap;
} buffer;

/* What an encoder step returns: done, a Python error is set, or leave this entry to Python. */
enum { DONE = 0, FAILED = -1, PUNT = 1 };

static int grow(buffer *b, Py_ssize_t more) {
    if (more > PY_SSIZE_T_MAX / 4 - b->n) { PyErr_NoMemory(); return FAILED; }
    Py_ssize_t cap = b->n + more;
    if (cap < 2 * b->cap) cap = 2 * b->cap;
    if (cap < 1 << 12) cap = 1 << 12;
    if (b->bytes == NULL) b->bytes = PyBytes_FromStringAndSize(NULL, cap);
    else if (_PyBytes_Resize(&b->bytes, cap) < 0) b->bytes = NULL;
    if (b->bytes == NULL) return FAILED;
    b->p = PyBytes_AS_STRING(b->bytes);
    b->cap = cap;
    return DONE;
}

static inline int reserve(buffer *b, Py_ssize_t more) {
    return b->n + more <= b->cap ? DONE : grow(b, more);
}

/* Inlined, so that the copy of a literal of known length is a few moves */
static inline __attribute__((always_inline)) int put(buffer *b, const char *s, Py_ssize_t k) {
    if (reserve(b, k) != DONE) return FAILED;
    memcpy(b->p + b->n, s, k);
    b->n += k;
    return DONE;
}

#define PUT(b, literal) put(b, literal, (Py_ssize_t)sizeof(literal) - 1)
/* Return from the enclosing encoder step unless the step `x` is DONE. */
#define STEP(x) do { int rc_ = (x); if (rc_ != DONE) return rc_; } while (0)

/* str(v) of an exact int of at most 64 bits; PUNT for anything else (bool, big ints) */
static int put_int(buffer *b, PyObject *v) {
    if (!PyLong_CheckExact(v)) return PUNT;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return PUNT;
    if (x == -1 && PyErr_Occurred()) return FAILED;
    static const char pairs[] =
        "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
        "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
        "8081828384858687888990919293949596979899";
    char digits[24];
    int k = sizeof digits;
    unsigned long long u = x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
    for (; u >= 100; u /= 100) {  /* two digits at a time */
        k -= 2;
        memcpy(digits + k, pairs + 2 * (u % 100), 2);
    }
    if (u >= 10) { k -= 2; memcpy(digits + k, pairs + 2 * u, 2); }
    else digits[--k] = (char)('0' + u);
    if (x < 0) digits[--k] = '-';
    return put(b, digits + k, (Py_ssize_t)sizeof digits - k);
}

/* `v` as it is (an f-string of an exact str), when it is ASCII; PUNT otherwise */
static int put_raw(buffer *b, PyObject *v) {
    if (!PyUnicode_CheckExact(v) || !PyUnicode_IS_ASCII(v)) return PUNT;
    return put(b, (const char *)PyUnicode_1BYTE_DATA(v), PyUnicode_GET_LENGTH(v));
}

/* How quote treats each byte: 0 bare, 1 bare but '#' or '|' (see is_plain), 2 never bare
 * (space, controls, ( ) " ; \ and everything beyond ASCII) */
static unsigned char atom_class[256];

static void init_atom_class(void) {
    for (int c = 0; c < 256; c++)
        atom_class[c] = (c <= ' ' || c >= 127 || c == '"' || c == '(' || c == ')' || c == ';' ||
                         c == '\\') ? 2 : (c == '#' || c == '|') ? 1 : 0;
}

/* Whether jckpt.format.sexp.quote writes the ASCII atom s[0:n] bare: printable, none of
 * space ( ) " ; \, no "#|" or "|#", not empty. (quote's "not starting #;" follows from
 * the ';'.) */
static int is_plain(const unsigned char *s, Py_ssize_t n) {
    int marks = 0;
    for (Py_ssize_t k = 0; k < n; k++) marks |= atom_class[s[k]];
    if (n == 0 || marks & 2) return 0;
    if (!marks) return 1;
    for (Py_ssize_t k = 1; k < n; k++)
        if ((s[k] == '|' && s[k - 1] == '#') || (s[k] == '#' && s[k - 1] == '|')) return 0;
    return 1;
}

/* jckpt.format.sexp.quote(v) of an exact str: bare, or quoted with OCaml escapes of its
 * UTF-8 bytes. PUNT for anything else (and for a str with no UTF-8, which Python refuses). */
static int put_quoted(buffer *b, PyObject *v) {
    if (!PyUnicode_CheckExact(v)) return PUNT;
    const unsigned char *s;
    Py_ssize_t n;
    if (PyUnicode_IS_ASCII(v)) {
        s = PyUnicode_1BYTE_DATA(v);
        n = PyUnicode_GET_LENGTH(v);
        if (is_plain(s, n)) return put(b, (const char *)s, n);
    } else {
        s = (const unsigned char *)PyUnicode_AsUTF8AndSize(v, &n);
        if (s == NULL) { PyErr_Clear(); return PUNT; }
    }
    if (n > (PY_SSIZE_T_MAX - 2) / 4 || reserve(b, 4 * n + 2) != DONE) return FAILED;
    char *o = b->p + b->n;
    *o++ = '"';
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned char c = s[k];
        switch (c) {
        case '"': *o++ = '\\'; *o++ = '"'; break;
        case '\\': *o++ = '\\'; *o++ = '\\'; break;
        case '\n': *o++ = '\\'; *o++ = 'n'; break;
        case '\t': *o++ = '\\'; *o++ = 't'; break;
        case '\r': *o++ = '\\'; *o++ = 'r'; break;
        case '\b': *o++ = '\\'; *o++ = 'b'; break;
        default:
            if (c >= 32 && c < 127) { *o++ = (char)c; break; }
            *o++ = '\\';
            *o++ = (char)('0' + c / 100);
            *o++ = (char)('0' + c / 10 % 10);
            *o++ = (char)('0' + c % 10);
        }
    }
    *o++ = '"';
    b->n = o - b->p;
    return DONE;
}

/* The items of an exact tuple, each written by `one` and separated by spaces */
static int put_each(buffer *b, PyObject *t, int (*one)(buffer *, PyObject *)) {
    if (!PyTuple_CheckExact(t)) return PUNT;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(t); k++) {
        if (k > 0) STEP(PUT(b, " "));
        STEP(one(b, PyTuple_GET_ITEM(t, k)));
    }
    return DONE;
}

/* An exact 2-tuple `(x y)` of ints */
static int put_int_pair(buffer *b, PyObject *t) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2) return PUNT;
    STEP(PUT(b, "("));
    STEP(put_int(b, PyTuple_GET_ITEM(t, 0)));
    STEP(PUT(b, " "));
    STEP(put_int(b, PyTuple_GET_ITEM(t, 1)));
    return PUT(b, ")");
}

/* A key path component: `(k VALUE)`, its value an int for the INT_KINDS ki, i and f and
 * quoted otherwise */
static int put_component(buffer *b, PyObject *t) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2) return PUNT;
    PyObject *kind = PyTuple_GET_ITEM(t, 0), *value = PyTuple_GET_ITEM(t, 1);
    if (!PyUnicode_CheckExact(kind)) return PUNT;
    if (!PyUnicode_IS_ASCII(kind)) return PUNT;
    const char *k = (const char *)PyUnicode_1BYTE_DATA(kind);
    Py_ssize_t n = PyUnicode_GET_LENGTH(kind);
    int numeric = (n == 1 && (k[0] == 'i' || k[0] == 'f')) || (n == 2 && k[0] == 'k' && k[1] == 'i');
    STEP(PUT(b, "("));
    STEP(put_raw(b, kind));
    STEP(PUT(b, " "));
    STEP(numeric ? put_int(b, value) : put_quoted(b, value));
    return PUT(b, ")");
}

enum { F_ID, F_NAMESPACE, F_PREC, F_DIMS, F_OFFSET, F_BYTE_LENGTH, F_LABEL, F_PADDING, F_PATH,
       F_CHECKSUM, F_KEY_IMPL, F_SLICE, F_GLOBAL_DIMS, F_EXTRA, N_FIELDS };

/* One entry's text, as _encode_entry writes it; *slot is where its checksum digits start in
 * the buffer (-1 when it has none). */
static int put_entry(buffer *b, PyObject **f, Py_ssize_t *slot) {
    if (f[F_PADDING] != Py_None || !PyTuple_CheckExact(f[F_EXTRA]) ||
        PyTuple_GET_SIZE(f[F_EXTRA]) != 0)
        return PUNT;
    STEP(PUT(b, "((id "));
    STEP(put_int(b, f[F_ID]));
    STEP(PUT(b, ") (namespace "));
    STEP(put_quoted(b, f[F_NAMESPACE]));
    STEP(PUT(b, ") (label ("));
    STEP(put_each(b, f[F_LABEL], put_quoted));
    STEP(PUT(b, ")) (prec "));
    STEP(put_raw(b, f[F_PREC]));
    STEP(PUT(b, ") (dims ("));
    STEP(put_each(b, f[F_DIMS], put_int));
    STEP(PUT(b, ")) (padding none) (offset "));
    STEP(put_int(b, f[F_OFFSET]));
    STEP(PUT(b, ") (byte_length "));
    STEP(put_int(b, f[F_BYTE_LENGTH]));
    STEP(PUT(b, ")"));
    if (f[F_PATH] != Py_None) {
        STEP(PUT(b, " (path ("));
        STEP(put_each(b, f[F_PATH], put_component));
        STEP(PUT(b, "))"));
    }
    *slot = -1;
    if (f[F_CHECKSUM] != Py_None) {
        PyObject *c = f[F_CHECKSUM];
        if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 2) return PUNT;
        STEP(PUT(b, " (checksum ("));
        STEP(put_quoted(b, PyTuple_GET_ITEM(c, 0)));
        STEP(PUT(b, " "));
        *slot = b->n;
        STEP(put_quoted(b, PyTuple_GET_ITEM(c, 1)));
        STEP(PUT(b, "))"));
    }
    if (f[F_KEY_IMPL] != Py_None) {
        STEP(PUT(b, " (key_impl "));
        STEP(put_quoted(b, f[F_KEY_IMPL]));
        STEP(PUT(b, ")"));
    }
    if (f[F_SLICE] != Py_None) {
        STEP(PUT(b, " (slice ("));
        STEP(put_each(b, f[F_SLICE], put_int_pair));
        STEP(PUT(b, "))"));
    }
    if (f[F_GLOBAL_DIMS] != Py_None) {
        STEP(PUT(b, " (global_dims ("));
        STEP(put_each(b, f[F_GLOBAL_DIMS], put_int));
        STEP(PUT(b, "))"));
    }
    return PUT(b, ")");
}

/* The entry's text from `fallback(entry)`, appended; *slot as put_entry's. PUNT when that
 * text is not ASCII. */
static int put_fallback(buffer *b, PyObject *fallback, PyObject *entry, Py_ssize_t *slot) {
    PyObject *found = PyObject_CallOneArg(fallback, entry);
    if (found == NULL) return FAILED;
    int rc = PUNT;
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 2 ||
        !PyUnicode_Check(PyTuple_GET_ITEM(found, 0))) {
        PyErr_SetString(PyExc_TypeError,
                        "encode_entries: the fallback must return (str, int | None)");
        rc = FAILED;
        goto done;
    }
    PyObject *text = PyTuple_GET_ITEM(found, 0), *at = PyTuple_GET_ITEM(found, 1);
    if (!PyUnicode_IS_ASCII(text)) goto done;
    Py_ssize_t start = b->n;
    *slot = -1;
    if (at != Py_None) {
        Py_ssize_t k = PyLong_AsSsize_t(at);
        if (k == -1 && PyErr_Occurred()) { rc = FAILED; goto done; }
        *slot = start + k;
    }
    rc = put(b, (const char *)PyUnicode_1BYTE_DATA(text), PyUnicode_GET_LENGTH(text));
done:
    Py_DECREF(found);
    return rc;
}

/* The entries' texts joined by "\n   " into `b`, and their checksum slots (from `base`) */
static int put_entries(buffer *b, PyObject *entries, PyObject *entry_type,
                       const Py_ssize_t *offsets, PyObject *fallback, Py_ssize_t base,
                       PyObject *slots) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entries); i++) {
        if (i > 0 && PUT(b, "\n   ") != DONE) return FAILED;
        PyObject *e = PyTuple_GET_ITEM(entries, i);
        PyObject *f[N_FIELDS];
        int rc = Py_IS_TYPE(e, (PyTypeObject *)entry_type) ? DONE : PUNT;
        for (int k = 0; k < N_FIELDS && rc == DONE; k++) {
            f[k] = *(PyObject **)((char *)e + offsets[k]);
            if (f[k] == NULL) rc = PUNT;  /* an unset slot: Python raises its AttributeError */
        }
        Py_ssize_t start = b->n, slot = -1;
        if (rc == DONE) rc = put_entry(b, f, &slot);
        if (rc == PUNT) {
            b->n = start;
            rc = put_fallback(b, fallback, e, &slot);
        }
        if (rc != DONE) return rc;
        if (i == 0) {  /* room for as many more entries like this one, and an eighth: one copy */
            Py_ssize_t rest = PyTuple_GET_SIZE(entries) - 1, each = b->n - start + 4;
            if (rest > 0 && each <= PY_SSIZE_T_MAX / 2 / rest &&
                reserve(b, each * rest / 8 * 9 + 4096) != DONE)
                return FAILED;
        }
        PyObject *at = slot < 0 ? Py_NewRef(Py_None) : PyLong_FromSsize_t(base + slot);
        if (at == NULL) return FAILED;
        PyList_SET_ITEM(slots, i, at);
    }
    return DONE;
}

static PyObject *encode_entries(PyObject *self, PyObject *args) {
    PyObject *seq, *entry_type, *fields, *fallback;
    Py_ssize_t base, offsets[N_FIELDS];
    if (!PyArg_ParseTuple(args, "OOO!On", &seq, &entry_type, &PyTuple_Type, &fields, &fallback,
                          &base))
        return NULL;
    if (!PyType_Check(entry_type) || PyTuple_GET_SIZE(fields) != N_FIELDS ||
        !PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "encode_entries: unexpected arguments");
        return NULL;
    }
    if (slot_offsets(entry_type, fields, offsets) < 0) return NULL;
    PyObject *entries = PySequence_Tuple(seq);  /* the fallback cannot change it under us */
    if (entries == NULL) return NULL;
    PyObject *slots = PyList_New(PyTuple_GET_SIZE(entries)), *out = NULL;
    buffer b = {NULL, NULL, 0, 0};
    if (slots == NULL || reserve(&b, 1) != DONE) goto end;
    int rc = put_entries(&b, entries, entry_type, offsets, fallback, base, slots);
    if (rc == PUNT) out = Py_NewRef(Py_None);
    if (rc != DONE || _PyBytes_Resize(&b.bytes, b.n) < 0) goto end;
    out = PyTuple_Pack(2, b.bytes, slots);
end:
    Py_XDECREF(b.bytes);
    Py_XDECREF(slots);
    Py_DECREF(entries);
    return out;
}

/* --- building the entries of host leaves ------------------------------------------------- */

/* host[i]'s label (its path's values, an int as its decimal text), or NULL without an error
 * when the path is not a tuple of (kind, str | int) pairs no longer than max_path. */
static PyObject *label_of(PyObject *path, Py_ssize_t max_path) {
    if (!PyTuple_CheckExact(path) || PyTuple_GET_SIZE(path) > max_path) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    PyObject *label = PyTuple_New(n);
    if (label == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *c = PyTuple_GET_ITEM(path, k), *v, *text;
        if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 2) goto punt;
        v = PyTuple_GET_ITEM(c, 1);
        if (PyUnicode_CheckExact(v)) { text = v; Py_INCREF(v); }
        else if (PyLong_CheckExact(v)) { if ((text = PyObject_Str(v)) == NULL) goto punt; }
        else goto punt;
        PyTuple_SET_ITEM(label, k, text);
    }
    return label;
punt:
    Py_DECREF(label);
    return NULL;
}

/* Elements of a shape tuple of exact non-negative ints times size, or -1 when not that. */
static long long shape_bytes(PyObject *shape, long long size) {
    if (!PyTuple_CheckExact(shape)) return -1;
    long long total = size;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape); k++) {
        PyObject *d = PyTuple_GET_ITEM(shape, k);
        if (!PyLong_CheckExact(d)) return -1;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(d, &overflow);
        if (overflow || v < 0 || __builtin_mul_overflow(total, v, &total)) { PyErr_Clear(); return -1; }
    }
    return total;
}

typedef struct {
    PyObject *precs, *hasher, *algorithm, *entry_type, *bytes_source, *uint8, *namespace;
    PyObject *reshape, *view, *minus_one, *dtype_name, *asarray, *cast, *byte_format;
    Py_ssize_t offsets[14], max_path;
    long long small_limit;
} leaf_context;

/* small_payload's way for an array the buffer protocol does not give as bytes: numpy's
 * asarray(array).reshape(-1).view(uint8), or NULL (without an error where that fails). */
static PyObject *numpy_payload(const leaf_context *x, PyObject *array, long long nbytes) {
    PyObject *as = PyObject_CallOneArg(x->asarray, array);
    if (as == NULL) { PyErr_Clear(); return NULL; }
    Py_buffer view;
    if (PyObject_GetBuffer(as, &view, PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); Py_DECREF(as); return NULL; }
    int fits = view.len == nbytes, flat = view.ndim == 1;
    PyBuffer_Release(&view);
    if (!fits) { Py_DECREF(as); return NULL; }
    PyObject *args[2] = {as, x->minus_one};
    if (!flat) {  /* as.reshape(-1), a view of the contiguous array */
        args[0] = PyObject_VectorcallMethod(x->reshape, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(as);
        if (args[0] == NULL) { PyErr_Clear(); return NULL; }
    }
    args[1] = x->uint8;
    PyObject *data = PyObject_VectorcallMethod(x->view, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(args[0]);
    if (data == NULL) PyErr_Clear();
    return data;
}

/* The payload of a small C-contiguous array of a storable (little-endian) dtype as a flat byte
 * view, or NULL (without an error where it is not such an array). The view is a memoryview of
 * the array's buffer cast to bytes: one buffer export, no numpy object, whether the array is a
 * numpy array or a jax.Array on a CPU device (whose buffer is host memory). Where the buffer
 * protocol does not give that (a jax.Array of bfloat16, int4 or float8, which JAX does not
 * export; an empty or complex array, which memoryview does not cast), the array as numpy
 * (asarray) reshaped and viewed as uint8. The bytes are the same either way. */
static PyObject *small_payload(const leaf_context *x, PyObject *array, long long nbytes) {
    if (nbytes >= x->small_limit) return NULL;
    PyObject *dtype = PyObject_GetAttr(array, x->dtype_name);
    if (dtype == NULL) { PyErr_Clear(); return NULL; }
    PyObject *known = PyDict_GetItemWithError(x->precs, dtype);
    Py_DECREF(dtype);
    if (known == NULL) { PyErr_Clear(); return NULL; }
    PyObject *view = PyMemoryView_FromObject(array);
    if (view != NULL) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(view);
        if (b->len != nbytes || !PyBuffer_IsContiguous(b, 'C')) { Py_DECREF(view); return NULL; }
        if (b->ndim == 1 && b->format != NULL && strcmp(b->format, "B") == 0) return view;
        PyObject *args[2] = {view, x->byte_format};
        PyObject *flat = PyObject_VectorcallMethod(x->cast, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(view);
        if (flat != NULL) return flat;
    }
    PyErr_Clear();
    return numpy_payload(x, array, nbytes);
}

/* ('xxh3_64', 16 hex digits) of data. */
static PyObject *checksum_of(const leaf_context *x, PyObject *data) {
    PyObject *digest = PyObject_CallOneArg(x->hasher, data);
    if (digest == NULL) return NULL;
    unsigned long long h = PyLong_AsUnsignedLongLong(digest);
    Py_DECREF(digest);
    if (h == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *text = PyUnicode_New(16, 127);  /* "%016x", written out */
    if (text == NULL) return NULL;
    Py_UCS1 *hex = PyUnicode_1BYTE_DATA(text);
    for (int k = 15; k >= 0; k--, h >>= 4) hex[k] = "0123456789abcdef"[h & 15];
    PyObject *pair = PyTuple_Pack(2, x->algorithm, text);
    Py_DECREF(text);
    return pair;
}

/* One leaf's entry and source, appended; 1 when done, 0 to leave the leaf to Python, -1 on error. */
static int host_entry(const leaf_context *x, PyObject *path, PyObject *host, long long id,
                      long long *cursor, long long alignment, PyObject *entries, PyObject *sources) {
    if (!PyTuple_Check(host) || PyTuple_GET_SIZE(host) < 4) return 0;
    PyObject *dtype = PyTuple_GET_ITEM(host, 0), *shape = PyTuple_GET_ITEM(host, 1);
    PyObject *key_impl = PyTuple_GET_ITEM(host, 2), *array = PyTuple_GET_ITEM(host, 3);
    if (array == Py_None || (key_impl != Py_None && !PyUnicode_CheckExact(key_impl))) return 0;
    PyObject *prec = PyDict_GetItemWithError(x->precs, dtype);
    if (prec == NULL) { PyErr_Clear(); return 0; }
    long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(prec, 1));
    long long nbytes = shape_bytes(shape, size), offset = *cursor, end;
    if (nbytes < 0) return 0;
    if (alignment > 1) {
        if (__builtin_add_overflow(offset, alignment - 1, &offset)) return 0;
        offset -= offset % alignment;
    }
    if (__builtin_add_overflow(offset, nbytes, &end)) return 0;
    PyObject *values[14] = {NULL}, *data = NULL, *source = NULL;
    if ((values[6] = label_of(path, x->max_path)) == NULL) return PyErr_Occurred() ? -1 : 0;
    if ((data = small_payload(x, array, nbytes)) == NULL) goto punt;
    if ((values[9] = checksum_of(x, data)) == NULL) goto punt;
    PyTypeObject *bs = (PyTypeObject *)x->bytes_source;
    if ((source = bs->tp_alloc(bs, 2)) == NULL) goto punt;
    PyTuple_SET_ITEM(source, 0, data);
    data = NULL;
    Py_INCREF(values[9]);
    PyTuple_SET_ITEM(source, 1, values[9]);
    values[0] = PyLong_FromLongLong(id);
    values[4] = PyLong_FromLongLong(offset);
    values[5] = PyLong_FromLongLong(nbytes);
    values[13] = PyTuple_New(0);
    if (!values[0] || !values[4] || !values[5] || !values[13]) goto punt;
    values[1] = x->namespace; values[2] = PyTuple_GET_ITEM(prec, 0); values[3] = shape;
    values[7] = Py_None; values[8] = path; values[10] = key_impl;
    values[11] = Py_None; values[12] = Py_None;
    for (int k = 1; k < 13; k++) if (k != 4 && k != 5 && k != 6 && k != 9) Py_INCREF(values[k]);
    PyTypeObject *tp = (PyTypeObject *)x->entry_type;
    PyObject *entry = tp->tp_alloc(tp, 0);
    if (entry == NULL) goto punt;
    for (int k = 0; k < 14; k++) {  /* the slots take over the references */
        *(PyObject **)((char *)entry + x->offsets[k]) = values[k];
        values[k] = NULL;
    }
    int rc = PyList_Append(entries, entry);
    Py_DECREF(entry);
    if (rc == 0) rc = PyList_Append(sources, source);
    Py_DECREF(source);
    if (rc < 0) return -1;
    *cursor = end;
    return 1;
punt:
    for (int k = 0; k < 14; k++) Py_XDECREF(values[k]);
    Py_XDECREF(data);
    Py_XDECREF(source);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *host_entries(PyObject *self, PyObject *args) {
    leaf_context x;
    PyObject *paths, *hosts, *fields, *entries, *sources, *out = NULL;
    Py_ssize_t start;
    long long first_id, cursor, alignment;
    if (!PyArg_ParseTuple(args, "UO!O!nLLLLnO!OUOOOOOO!O!", &x.namespace, &PyList_Type, &paths,
                          &PyList_Type, &hosts, &start, &first_id, &cursor, &alignment,
                          &x.small_limit, &x.max_path, &PyDict_Type, &x.precs, &x.hasher,
                          &x.algorithm, &x.entry_type, &fields, &x.bytes_source, &x.uint8,
                          &x.asarray, &PyList_Type, &entries, &PyList_Type, &sources))
        return NULL;
    if (!PyType_Check(x.entry_type) || !PyType_Check(x.bytes_source) ||
        !PyType_IsSubtype((PyTypeObject *)x.bytes_source, &PyTuple_Type) ||
        !PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != 14 ||
        PyList_GET_SIZE(paths) != PyList_GET_SIZE(hosts) || start < 0) {
        PyErr_SetString(PyExc_TypeError, "host_entries: unexpected arguments");
        return NULL;
    }
    if (slot_offsets(x.entry_type, fields, x.offsets) < 0) return NULL;
    x.reshape = PyUnicode_InternFromString("reshape");
    x.view = PyUnicode_InternFromString("view");
    x.dtype_name = PyUnicode_InternFromString("dtype");
    x.minus_one = PyLong_FromLong(-1);
    x.cast = PyUnicode_InternFromString("cast");
    x.byte_format = PyUnicode_InternFromString("B");
    if (!x.reshape || !x.view || !x.dtype_name || !x.minus_one || !x.cast || !x.byte_format) goto done;
    Py_ssize_t i = start, n = PyList_GET_SIZE(hosts);
    for (; i < n; i++) {
        long long id;
        if (__builtin_add_overflow(first_id, (long long)(i - start), &id)) break;
        int rc = host_entry(&x, PyList_GET_ITEM(paths, i), PyList_GET_ITEM(hosts, i), id, &cursor,
                            alignment, entries, sources);
        if (rc < 0) goto done;
        if (rc == 0) break;
    }
    out = Py_BuildValue("(nL)", i, cursor);
done:
    Py_XDECREF(x.reshape);
    Py_XDECREF(x.view);
    Py_XDECREF(x.dtype_name);
    Py_XDECREF(x.minus_one);
    Py_XDECREF(x.cast);
    Py_XDECREF(x.byte_format);
    return out;
}


/* --- staging plain leaves on the host ----------------------------------------------------- */

/* host_leaf(dtype, shape, None, array, (), False) for a plain leaf, or NULL (an error set or
 * not) when the leaf is not plain. */
typedef struct {
    PyObject *storable, *shardings, *seen, *jax_types, *asarray, *empty;
    PyTypeObject *host_leaf, *ndarray;
    Py_ssize_t seen_max;
} stage_context;

/* seen: id -> (sharding, facts) of the shardings met lately (at most seen_max). A jitted
 * step's outputs, or arrays saved again, come with the same sharding objects every time: found
 * by identity here without calling the sharding's __hash__ and __eq__ (Python code) as
 * shardings[sharding] does. Holding each sharding keeps its id from being reused. */

/* The facts of a sharding (borrowed), NULL (an error set or not) when it has none yet. */
static PyObject *facts_of(const stage_context *x, PyObject *sharding) {
    PyObject *key = PyLong_FromVoidPtr(sharding);
    if (key == NULL) return NULL;
    PyObject *hit = PyDict_GetItemWithError(x->seen, key);
    PyObject *facts = NULL;
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 &&
        PyTuple_GET_ITEM(hit, 0) == sharding) {
        facts = PyTuple_GET_ITEM(hit, 1);
    } else if (!PyErr_Occurred() &&
               (facts = PyDict_GetItemWithError(x->shardings, sharding)) != NULL) {
        PyObject *pair = PyTuple_Pack(2, sharding, facts);
        if (PyDict_GET_SIZE(x->seen) >= x->seen_max) PyDict_Clear(x->seen);
        if (pair == NULL || PyDict_SetItem(x->seen, key, pair) < 0) facts = NULL;
        Py_XDECREF(pair);
    }
    Py_DECREF(key);
    return facts;
}

static PyObject *plain_leaf(const stage_context *x, PyObject *leaf) {
    PyObject *array, *dtype = NULL, *shape = NULL;
    if (Py_IS_TYPE(leaf, x->ndarray)) {
        array = Py_NewRef(leaf);
    } else {
        int known = PySet_Contains(x->jax_types, (PyObject *)Py_TYPE(leaf));
        if (known <= 0) return NULL;
        PyObject *sharding = PyObject_GetAttrString(leaf, "sharding");
        if (sharding == NULL) return NULL;
        PyObject *facts = facts_of(x, sharding);  /* borrowed */
        Py_DECREF(sharding);
        if (facts == NULL || !PyTuple_Check(facts) || PyTuple_GET_SIZE(facts) < 3 ||
            PyTuple_GET_ITEM(facts, 0) != Py_True || PyTuple_GET_ITEM(facts, 1) != Py_False ||
            PyTuple_GET_ITEM(facts, 2) != Py_True)
            return NULL;
        if (x->asarray == Py_None) {
            array = Py_NewRef(leaf);  /* kept as it is: its dtype and shape are numpy's */
        } else {
            if ((array = PyObject_CallOneArg(x->asarray, leaf)) == NULL) return NULL;
            if (!Py_IS_TYPE(array, x->ndarray)) goto punt;
        }
    }
    if ((dtype = PyObject_GetAttrString(array, "dtype")) == NULL) goto punt;
    if (PySet_Contains(x->storable, dtype) != 1) goto punt;
    if ((shape = PyObject_GetAttrString(array, "shape")) == NULL) goto punt;
    PyObject *out = x->host_leaf->tp_alloc(x->host_leaf, 6);
    if (out == NULL) goto punt;
    PyObject *items[6] = {dtype, shape, Py_NewRef(Py_None), array, Py_NewRef(x->empty),
                          Py_NewRef(Py_False)};
    for (int k = 0; k < 6; k++) PyTuple_SET_ITEM(out, k, items[k]);
    return out;
punt:
    Py_DECREF(array);
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    return NULL;
}

static PyObject *stage_leaves(PyObject *self, PyObject *args) {
    stage_context x;
    PyObject *leaves, *out;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "O!nO!O!O!nO!O!OO!O!", &PyList_Type, &leaves, &i, &PySet_Type,
                          &x.storable, &PyDict_Type, &x.shardings, &PyDict_Type, &x.seen,
                          &x.seen_max, &PyFrozenSet_Type, &x.jax_types,
                          &PyType_Type, &x.host_leaf, &x.asarray, &PyList_Type, &out, &PyType_Type,
                          &x.ndarray))
        return NULL;
    if (!PyType_IsSubtype(x.host_leaf, &PyTuple_Type) || i < 0) {
        PyErr_SetString(PyExc_TypeError, "stage_leaves: unexpected arguments");
        return NULL;
    }
    if ((x.empty = PyTuple_New(0)) == NULL) return NULL;
    for (Py_ssize_t n = PyList_GET_SIZE(leaves); i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(leaves, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) break;
        PyObject *staged = plain_leaf(&x, PyTuple_GET_ITEM(pair, 1));
        if (staged == NULL) {
            PyErr_Clear();  /* the leaf is not plain (or asking it failed): Python stages it */
            break;
        }
        int rc = PyList_Append(out, staged);
        Py_DECREF(staged);
        if (rc < 0) { Py_DECREF(x.empty); return NULL; }
    }
    Py_DECREF(x.empty);
    return PyLong_FromSsize_t(i);
}


/* --- gathering small payloads for one writev ---------------------------------------------- */

static PyObject *gather_payloads(PyObject *self, PyObject *args) {
    PyObject *entries, *sources, *source_type, *zeros, *pending, *sums;
    Py_ssize_t i, max_buffers;
    long long base, position, max_bytes, added = 0;
    if (!PyArg_ParseTuple(args, "O!O!nLLO!OO!O!nL", &PyList_Type, &entries, &PyList_Type, &sources,
                          &i, &base, &position, &PyType_Type, &source_type, &zeros, &PyList_Type,
                          &pending, &PyList_Type, &sums, &max_buffers, &max_bytes))
        return NULL;
    if (!PyMemoryView_Check(zeros) || PyList_GET_SIZE(entries) != PyList_GET_SIZE(sources) || i < 0) {
        PyErr_SetString(PyExc_TypeError, "gather_payloads: unexpected arguments");
        return NULL;
    }
    PyObject *offset_name = PyUnicode_InternFromString("offset");
    PyObject *length_name = PyUnicode_InternFromString("byte_length");
    if (offset_name == NULL || length_name == NULL) goto error;
    Py_ssize_t n_zeros = PyObject_Length(zeros);
    for (Py_ssize_t n = PyList_GET_SIZE(sources); i < n; i++) {
        PyObject *source = PyList_GET_ITEM(sources, i), *entry = PyList_GET_ITEM(entries, i);
        if (!Py_IS_TYPE(source, (PyTypeObject *)source_type) || PyTuple_GET_SIZE(source) != 2) break;
        PyObject *data = PyTuple_GET_ITEM(source, 0);
        Py_ssize_t size = PyObject_Length(data);
        if (size < 0) { PyErr_Clear(); break; }
        PyObject *o = PyObject_GetAttr(entry, offset_name), *l;
        if (o == NULL) { PyErr_Clear(); break; }
        long long offset = PyLong_AsLongLong(o), length;
        Py_DECREF(o);
        if ((l = PyObject_GetAttr(entry, length_name)) == NULL) { PyErr_Clear(); break; }
        length = PyLong_AsLongLong(l);
        Py_DECREF(l);
        if (PyErr_Occurred()) { PyErr_Clear(); break; }
        long long at = base + offset, pad = at - position;
        if (length != size || pad < 0 || pad > n_zeros) break;
        if (PyList_GET_SIZE(pending) + 2 > max_buffers || added + pad + size > max_bytes) break;
        if (pad > 0) {
            PyObject *z = PySequence_GetSlice(zeros, 0, (Py_ssize_t)pad);
            if (z == NULL) goto error;
            int rc = PyList_Append(pending, z);
            Py_DECREF(z);
            if (rc < 0) goto error;
        }
        if (PyList_Append(pending, data) < 0 || PyList_Append(sums, PyTuple_GET_ITEM(source, 1)) < 0)
            goto error;
        position = at + size;
        added += pad + size;
    }
    Py_DECREF(offset_name);
    Py_DECREF(length_name);
    return Py_BuildValue("(nLL)", i, position, added);
error:
    Py_XDECREF(offset_name);
    Py_XDECREF(length_name);
    return NULL;
}


/* --- mapping a load's payloads ------------------------------------------------------------- */

/* entry's payload as a view of buffer, or None (a new reference; NULL on a Python error). */
static PyObject *map_payload(PyObject *buffer, PyObject *entry, long long data_start, long long size,
                             PyObject *precs, PyObject *frombuffer, PyObject *const *names) {
    PyObject *v[5] = {NULL};  /* prec, dims, padding, offset, byte_length */
    PyObject *out = NULL, *flat = NULL;
    for (int k = 0; k < 5; k++)
        if ((v[k] = PyObject_GetAttr(entry, names[k])) == NULL) { PyErr_Clear(); goto none; }
    if (v[2] != Py_None || !PyTuple_CheckExact(v[1]) || PyTuple_GET_SIZE(v[1]) > MAX_DIMS) goto none;
    PyObject *known = PyDict_GetItemWithError(precs, v[0]);  /* borrowed */
    if (known == NULL || !PyTuple_Check(known) || PyTuple_GET_SIZE(known) != 2) {
        PyErr_Clear();
        goto none;
    }
    long long itemsize = PyLong_AsLongLong(PyTuple_GET_ITEM(known, 1));
    long long offset = PyLong_AsLongLong(v[3]), length = PyLong_AsLongLong(v[4]);
    long long count = shape_bytes(v[1], 1), start, end;
    if (PyErr_Occurred()) { PyErr_Clear(); goto none; }
    if (itemsize <= 0 || count <= 0 || offset < 0 || __builtin_mul_overflow(count, itemsize, &end) ||
        end != length || __builtin_add_overflow(data_start, offset, &start) || start % itemsize ||
        __builtin_add_overflow(start, length, &end) || end > size)
        goto none;
    PyObject *c = PyLong_FromLongLong(count), *o = PyLong_FromLongLong(start);
    if (c == NULL || o == NULL) { Py_XDECREF(c); Py_XDECREF(o); goto error; }
    PyObject *args[4] = {buffer, PyTuple_GET_ITEM(known, 0), c, o};
    flat = PyObject_Vectorcall(frombuffer, args, 4, NULL);
    Py_DECREF(c);
    Py_DECREF(o);
    if (flat == NULL) { PyErr_Clear(); goto none; }  /* Python's decoder names what is wrong */
    if (PyTuple_GET_SIZE(v[1]) == 1) {
        out = flat;
        flat = NULL;
    } else {
        PyObject *rargs[2] = {flat, v[1]};
        out = PyObject_VectorcallMethod(names[5], rargs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (out == NULL) { PyErr_Clear(); goto none; }
    }
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
error:
    for (int k = 0; k < 5; k++) Py_XDECREF(v[k]);
    Py_XDECREF(flat);
    return out;
}

static PyObject *map_payloads(PyObject *self, PyObject *args) {
    PyObject *buffer, *entries, *precs, *frombuffer, *out;
    long long data_start, size;
    if (!PyArg_ParseTuple(args, "OO!LLO!OO!", &buffer, &PyList_Type, &entries, &data_start, &size,
                          &PyDict_Type, &precs, &frombuffer, &PyList_Type, &out))
        return NULL;
    static const char *fields[6] = {"prec", "dims", "padding", "offset", "byte_length", "reshape"};
    PyObject *names[6] = {NULL};
    Py_ssize_t mapped = 0, i = 0;
    for (int k = 0; k < 6; k++)
        if ((names[k] = PyUnicode_InternFromString(fields[k])) == NULL) goto error;
    for (; i < PyList_GET_SIZE(entries); i++) {
        PyObject *array = map_payload(buffer, PyList_GET_ITEM(entries, i), data_start, size, precs,
                                      frombuffer, names);
        if (array == NULL) goto error;
        mapped += array != Py_None;
        int rc = PyList_Append(out, array);
        Py_DECREF(array);
        if (rc < 0) goto error;
    }
    for (int k = 0; k < 6; k++) Py_DECREF(names[k]);
    return PyLong_FromSsize_t(mapped);
error:
    for (int k = 0; k < 6; k++) Py_XDECREF(names[k]);
    return NULL;
}


/* --- copying a snapshot's host arrays ------------------------------------------------------ */

/* A buffer format less a native byte-order prefix ('@' or '='): numpy writes "f" where
 * jax arrays write "=f" (the itemsizes are compared too, which tells native sizes apart). */
static const char *plain_format(const char *format) {
    return format[0] == '@' || format[0] == '=' ? format + 1 : format;
}

/* 1 when src was copied into dst, 0 when they are not plain buffers of the same layout. */
static int copy_array(PyObject *dst, PyObject *src) {
    Py_buffer d, s;
    if (PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&d);
        return 0;
    }
    int same = d.len == s.len && d.itemsize == s.itemsize && d.ndim == s.ndim &&
               d.format != NULL && s.format != NULL &&
               strcmp(plain_format(d.format), plain_format(s.format)) == 0 &&
               d.buf != s.buf;
    for (int k = 0; same && k < d.ndim; k++) same = d.shape[k] == s.shape[k];
    if (same) {
        if (d.len >= (1 << 16)) {
            Py_BEGIN_ALLOW_THREADS
            memcpy(d.buf, s.buf, (size_t)d.len);
            Py_END_ALLOW_THREADS
        } else {
            memcpy(d.buf, s.buf, (size_t)d.len);
        }
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return same;
}

static PyObject *copy_arrays(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &dsts, &PyList_Type, &srcs))
        return NULL;
    if (PyList_GET_SIZE(dsts) != PyList_GET_SIZE(srcs)) {
        PyErr_SetString(PyExc_TypeError, "copy_arrays: as many destinations as sources");
        return NULL;
    }
    PyObject *left = PyList_New(0);
    if (left == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(dsts); i++) {
        if (copy_array(PyList_GET_ITEM(dsts, i), PyList_GET_ITEM(srcs, i))) continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL || PyList_Append(left, index) < 0) {
            Py_XDECREF(index);
            Py_DECREF(left);
            return NULL;
        }
        Py_DECREF(index);
    }
    return left;
}

static PyMethodDef methods[] = {
    {"host_entries", host_entries, METH_VARARGS,
     "Entries and sources of small host leaves, from `start` on: (where it stopped, cursor)."},
    {"copy_arrays", copy_arrays, METH_VARARGS,
     "Copy each source into its destination where both are plain buffers alike: the rest."},
    {"map_payloads", map_payloads, METH_VARARGS,
     "Views of a load's payloads in the mapping (None where Python decodes): how many."},
    {"gather_payloads", gather_payloads, METH_VARARGS,
     "Gather a run of small payloads for one writev: (where it stopped, position, bytes)."},
    {"stage_leaves", stage_leaves, METH_VARARGS,
     "A run of plain leaves staged on the host, from `start` on: where it stopped."},
    {"decode_entries", decode_entries, METH_VARARGS,
     "Decode a canonical tensors list; None when the text is not canonical."},
    {"encode_entries", encode_entries, METH_VARARGS,
     "Encode entries as jckpt writes them: (text, checksum slots); None to encode in Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_canonical",
    "Optional accelerator for decoding and encoding headers laid out as jckpt writes them.", -1, methods,
};

PyMODINIT_FUNC PyInit__canonical(void) {
    init_atom_class();
    return PyModule_Create(&module);
}
