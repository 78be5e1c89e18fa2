/* Decoding of the canonical tensors list: the entries exactly as jckpt writes them.
 *
 * This is an optional accelerator for jckpt.format.fastpath.canonical_entries: it
 * accepts exactly the language of the regular expression _CANONICAL_ENTRY there and
 * builds the same Entry objects, so a header decodes identically with or without it.
 * Anything outside that language (quoted atoms, padding, unknown fields, integers of
 * more than 18 digits, an unknown prec, a byte_length that disagrees with the dims, a
 * piece's slice that does not fit its dims and global_dims) returns None, and the Python reader takes over with its full validation.
 *
 *   decode_entries(text: str, pos: int, entry_type: type, fields: tuple[str, ...],
 *                  precs: dict[str, tuple[str, int]], kinds: tuple[str, ...])
 *     -> tuple[list[Entry], int] | None
 *
 * On success the int is the position of the ')' that closes the tensors list.
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

static PyObject *decode_entries(PyObject *self, PyObject *args) {
    PyObject *text, *entry_type, *fields, *precs, *kinds;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "UnOO!O!O!", &text, &pos, &entry_type, &PyTuple_Type, &fields,
                          &PyDict_Type, &precs, &PyTuple_Type, &kinds))
        return NULL;
    if (!PyType_Check(entry_type) || PyTuple_GET_SIZE(fields) != 14 ||
        PyTuple_GET_SIZE(kinds) != 5) {
        PyErr_SetString(PyExc_TypeError, "decode_entries: unexpected arguments");
        return NULL;
    }
    /* The entry type's fields are __slots__: find each slot's offset in the object. */
    Py_ssize_t offsets[14];
    for (int k = 0; k < 14; k++) {
        PyObject *descr = PyObject_GetAttr(entry_type, PyTuple_GET_ITEM(fields, k));
        if (descr == NULL) return NULL;
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok) offsets[k] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "decode_entries: the entry type must use __slots__");
            return NULL;
        }
    }
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
    if (entries == NULL || cache == NULL || empty == NULL) goto error;

    for (;;) {
        Py_ssize_t save = c->i;
        run(c, is_space);
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
                    FAIL_IF(!lit(c, "("));
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
    Py_RETURN_NONE;
error:
    for (int k = 0; k < 14; k++) Py_CLEAR(values[k]);
    Py_XDECREF(items);
    Py_XDECREF(entries);
    Py_XDECREF(cache);
    Py_XDECREF(empty);
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode_entries", decode_entries, METH_VARARGS,
     "Decode a canonical tensors list; None when the text is not canonical."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_canonical",
    "Optional accelerator for decoding headers laid out as jckpt writes them.", -1, methods,
};

PyMODINIT_FUNC PyInit__canonical(void) { return PyModule_Create(&module); }
