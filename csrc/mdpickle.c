/* dump_metadata: the checkpoint's .metadata pickle, written from C.
 *
 * The .metadata file is pickle.dump(Metadata) (docs/format.md).  Python's
 * pickler spends most of a many-tensor save's metadata time asking each
 * dataclass instance how to reduce itself (object.__reduce_ex__, copyreg);
 * the object graph of DCP metadata is made of a closed set of types whose
 * reduction is known, so this encoder walks it and writes the opcodes
 * directly.  The stream loads to objects equal to what Python's pickler
 * writes (the same reductions, protocol and memo back-references); anything
 * outside the set returns None and dcpx/formats/metadata.py uses Python's pickler.
 *
 * The caller passes `kinds`, a dict {type: (kind, reducer)} that
 * dcpx/formats/metadata.py builds once after checking each type still pickles the
 * way the kind assumes (no __reduce__ override, no copyreg entry, ...):
 *   KIND_PLAIN     cls.__new__(cls) + BUILD with the instance __dict__
 *                  (object.__reduce_ex__ of a dataclass);
 *   KIND_GETSTATE  the same with obj.__getstate__() as the state
 *                  (TensorProperties);
 *   KIND_STORAGE   _StorageInfo(path, offset, length) without transform
 *                  descriptors (dcpx's reducer_override), else GETSTATE;
 *   KIND_SIZE      torch.Size(tuple(obj));
 *   KIND_REDUCE    whatever reducer(obj) or obj.__reduce_ex__(protocol)
 *                  returns, a global name or (callable, args) (dtypes,
 *                  layouts, enum members, paths).
 * Exact str, int, float, bool, None, tuple, list and dict are encoded as
 * the pickler encodes them.  Opcodes: Lib/pickletools.py; framing: PEP 3154.
 *
 * Memo: an object is given a memo slot (and back-referenced when met again)
 * only if something besides its one parent can hold it: every encode call
 * holds a reference of its own, so Py_REFCNT(obj) > 2 means another holder.
 * An object that appears twice in the graph always has two holders, so no
 * sharing is lost; unshared ones (most dataclass instances, their state
 * dicts, argument tuples) save a MEMOIZE opcode each, and the file is never
 * larger than Python's.  The memo holds a reference to every memoized
 * object, so a freed temporary's address cannot be mistaken for it later,
 * and so an unshared object is not even looked up.
 *
 * Runs with the GIL held throughout: reductions and __getstate__ are
 * Python calls, and may change the graph; every object being written is
 * held, and a dict that changes size raises as in the pickler.
 */
#include "dcpx.h"

#include <string.h>

enum {
    KIND_PLAIN = 0,
    KIND_GETSTATE = 1,
    KIND_STORAGE = 2,
    KIND_SIZE = 3,
    KIND_REDUCE = 4,
};

/* Return codes of the encoders: 0 done, ERR an exception is set, UNSUP the
 * object is outside the closed set (no exception set). */
#define ERR (-1)
#define UNSUP (-2)

#define FRAME_TARGET 65536 /* as Modules/_pickle.c */
#define FRAME_HEADER 9
#define BATCH 1000

typedef struct {
    PyObject *key; /* owned; NULL = empty slot */
    uint32_t idx;
} memo_slot;

typedef struct {
    char *buf; /* PyMem_Malloc'd output */
    size_t len, cap;
    Py_ssize_t frame_start; /* offset of the open frame's header, or -1 */
    int framing;
    memo_slot *memo; /* open addressing, cap a power of two */
    size_t memo_cap, memo_used;
    int nomemo;       /* write no MEMOIZE and no memo reference (a tail) */
    PyObject *kinds;  /* borrowed: {type: (kind, reducer)} */
    PyObject *proto;  /* owned: the protocol as an int */
    /* owned, interned: _StorageInfo's attribute names (enc_storage) */
    PyObject *names[4];
} enc;

static const char *const storage_names[4] = {
    "relative_path", "offset", "length", "transform_descriptors"};

static int enc_obj(enc *e, PyObject *o);

/* ---- output ---------------------------------------------------------- */

static int grow(enc *e, size_t n)
{
    size_t cap = e->cap ? e->cap : 4096;
    char *p;
    if (n <= e->cap - e->len)
        return 0;
    while (cap - e->len < n) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return ERR;
        }
        cap *= 2;
    }
    p = PyMem_Realloc(e->buf, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    e->buf = p;
    e->cap = cap;
    return 0;
}

/* Append n bytes, opening a frame first if framing and none is open. */
static int put(enc *e, const void *p, size_t n)
{
    if (e->framing && e->frame_start < 0) {
        if (grow(e, FRAME_HEADER) < 0)
            return ERR;
        e->frame_start = (Py_ssize_t)e->len;
        e->len += FRAME_HEADER;
    }
    if (grow(e, n) < 0)
        return ERR;
    memcpy(e->buf + e->len, p, n);
    e->len += n;
    return 0;
}

static int put1(enc *e, char op) { return put(e, &op, 1); }

static void le_bytes(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* Close the open frame: write its header, or drop it if under 4 bytes. */
static void commit_frame(enc *e)
{
    size_t n;
    if (e->frame_start < 0)
        return;
    n = e->len - (size_t)e->frame_start - FRAME_HEADER;
    if (n >= 4) {
        unsigned char *h = (unsigned char *)e->buf + e->frame_start;
        h[0] = 0x95; /* FRAME */
        le_bytes(h + 1, n, 8);
    }
    else {
        memmove(e->buf + e->frame_start, e->buf + e->frame_start + FRAME_HEADER, n);
        e->len -= FRAME_HEADER;
    }
    e->frame_start = -1;
}

/* Called between objects: frames end at object boundaries, near 64 KiB. */
static void boundary(enc *e)
{
    if (e->frame_start >= 0
        && e->len - (size_t)e->frame_start - FRAME_HEADER >= FRAME_TARGET)
        commit_frame(e);
}

/* ---- memo ------------------------------------------------------------ */

static size_t slot_of(const enc *e, PyObject *o)
{
    uint64_t h = (uint64_t)(uintptr_t)o * 0x9E3779B97F4A7C15ULL;
    size_t i = (size_t)(h >> 32) & (e->memo_cap - 1);
    while (e->memo[i].key != NULL && e->memo[i].key != o)
        i = (i + 1) & (e->memo_cap - 1);
    return i;
}

static long memo_find(const enc *e, PyObject *o)
{
    size_t i;
    if (e->nomemo)
        return -1;
    i = slot_of(e, o);
    return e->memo[i].key == o ? (long)e->memo[i].idx : -1;
}

static int memo_grow(enc *e)
{
    size_t old_cap = e->memo_cap, cap = old_cap ? old_cap * 2 : 1024;
    memo_slot *old = e->memo;
    e->memo = PyMem_Calloc(cap, sizeof(memo_slot));
    if (e->memo == NULL) {
        e->memo = old;
        PyErr_NoMemory();
        return ERR;
    }
    e->memo_cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].key != NULL)
            e->memo[slot_of(e, old[i].key)] = old[i];
    PyMem_Free(old);
    return 0;
}

/* MEMOIZE o (the next memo index) and remember it. */
static int memo_put(enc *e, PyObject *o)
{
    size_t i;
    if (e->nomemo)
        return 0;
    if (e->memo_used >= UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "dcpx: metadata memo too large");
        return ERR;
    }
    if ((e->memo_used + 1) * 2 > e->memo_cap && memo_grow(e) < 0)
        return ERR;
    if (put1(e, (char)0x94) < 0) /* MEMOIZE */
        return ERR;
    i = slot_of(e, o);
    Py_INCREF(o);
    e->memo[i].key = o;
    e->memo[i].idx = (uint32_t)e->memo_used++;
    return 0;
}

/* See the file comment: the caller holds one reference of its own. */
static int shared(PyObject *o) { return Py_REFCNT(o) > 2; }

static int memo_put_if_shared(enc *e, PyObject *o)
{
    return shared(o) ? memo_put(e, o) : 0;
}

static int put_get(enc *e, long idx)
{
    unsigned char b[5];
    if (idx < 256) {
        b[0] = 'h'; /* BINGET */
        b[1] = (unsigned char)idx;
        return put(e, b, 2);
    }
    b[0] = 'j'; /* LONG_BINGET */
    le_bytes(b + 1, (uint64_t)idx, 4);
    return put(e, b, 5);
}

/* ---- atoms ------------------------------------------------------------ */

/* LONG1/LONG4 with the bytes of encode_long() in Lib/pickle.py. */
static int put_long_bytes(enc *e, const unsigned char *p, size_t n)
{
    unsigned char h[5];
    if (n < 256) {
        h[0] = (unsigned char)0x8a; /* LONG1 */
        h[1] = (unsigned char)n;
        if (put(e, h, 2) < 0)
            return ERR;
    }
    else {
        if (n > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "dcpx: int too large to pickle");
            return ERR;
        }
        h[0] = (unsigned char)0x8b; /* LONG4 */
        le_bytes(h + 1, n, 4);
        if (put(e, h, 5) < 0)
            return ERR;
    }
    return put(e, p, n);
}

static size_t trim_negative(const unsigned char *p, size_t n, int negative)
{
    if (negative && n > 1 && p[n - 1] == 0xff && (p[n - 2] & 0x80))
        n--;
    return n;
}

/* Beyond 64 bits: o.to_bytes(n, "little", signed=True) does the two's
 * complement, n as encode_long() in Lib/pickle.py. */
static int enc_bigint(enc *e, PyObject *o)
{
    PyObject *bl = NULL, *meth = NULL, *args = NULL, *kw = NULL, *b = NULL;
    PyObject *zero = NULL;
    int rc = ERR, neg;
    size_t n;
    bl = PyObject_CallMethod(o, "bit_length", NULL);
    if (bl == NULL)
        goto done;
    n = PyLong_AsSize_t(bl);
    if (n == (size_t)-1 && PyErr_Occurred())
        goto done;
    n = (n >> 3) + 1;
    meth = PyObject_GetAttrString(o, "to_bytes");
    args = meth ? Py_BuildValue("(ns)", (Py_ssize_t)n, "little") : NULL;
    kw = args ? Py_BuildValue("{s:O}", "signed", Py_True) : NULL;
    b = kw ? PyObject_Call(meth, args, kw) : NULL;
    zero = b ? PyLong_FromLong(0) : NULL;
    if (zero == NULL)
        goto done;
    if (!PyBytes_Check(b)) {
        PyErr_SetString(PyExc_TypeError, "dcpx: int.to_bytes returned no bytes");
        goto done;
    }
    neg = PyObject_RichCompareBool(o, zero, Py_LT);
    if (neg < 0)
        goto done;
    n = trim_negative((const unsigned char *)PyBytes_AS_STRING(b),
                      (size_t)PyBytes_GET_SIZE(b), neg);
    rc = put_long_bytes(e, (const unsigned char *)PyBytes_AS_STRING(b), n);
done:
    Py_XDECREF(bl);
    Py_XDECREF(meth);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(b);
    Py_XDECREF(zero);
    return rc;
}

static int enc_int(enc *e, PyObject *o)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    unsigned char b[9];
    if (v == -1 && PyErr_Occurred())
        return ERR;
    if (overflow)
        return enc_bigint(e, o);
    if (v >= 0 && v < 256) {
        b[0] = 'K';
        b[1] = (unsigned char)v;
        return put(e, b, 2);
    }
    if (v >= 0 && v < 65536) {
        b[0] = 'M';
        le_bytes(b + 1, (uint64_t)v, 2);
        return put(e, b, 3);
    }
    if (v >= -2147483647LL - 1 && v <= 2147483647LL) {
        b[0] = 'J';
        le_bytes(b + 1, (uint64_t)v, 4);
        return put(e, b, 5);
    }
    {
        uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
        int nbits = 64 - __builtin_clzll(u);
        size_t n = (size_t)(nbits >> 3) + 1;
        le_bytes(b, (uint64_t)v, 8);
        b[8] = v < 0 ? 0xff : 0;
        return put_long_bytes(e, b, trim_negative(b, n, v < 0));
    }
}

static int enc_float(enc *e, PyObject *o)
{
    double d = PyFloat_AS_DOUBLE(o);
    uint64_t u;
    unsigned char b[9];
    memcpy(&u, &d, 8);
    b[0] = 'G'; /* BINFLOAT: IEEE 754 big-endian */
    for (int i = 0; i < 8; i++)
        b[1 + i] = (unsigned char)(u >> (56 - 8 * i));
    return put(e, b, 9);
}

static int enc_str(enc *e, PyObject *o)
{
    Py_ssize_t n;
    PyObject *tmp = NULL;
    const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    unsigned char h[9];
    size_t hn;
    int rc = ERR;
    if (s == NULL) { /* lone surrogates: as the pickler, surrogatepass */
        PyErr_Clear();
        tmp = PyUnicode_AsEncodedString(o, "utf-8", "surrogatepass");
        if (tmp == NULL)
            return ERR;
        s = PyBytes_AS_STRING(tmp);
        n = PyBytes_GET_SIZE(tmp);
    }
    if (n < 256) {
        h[0] = (unsigned char)0x8c; /* SHORT_BINUNICODE */
        h[1] = (unsigned char)n;
        hn = 2;
    }
    else if ((uint64_t)n <= UINT32_MAX) {
        h[0] = 'X'; /* BINUNICODE */
        le_bytes(h + 1, (uint64_t)n, 4);
        hn = 5;
    }
    else {
        h[0] = (unsigned char)0x8d; /* BINUNICODE8 */
        le_bytes(h + 1, (uint64_t)n, 8);
        hn = 9;
    }
    if (n >= FRAME_TARGET) {
        /* As the pickler: a large payload goes between frames. */
        commit_frame(e);
        e->framing = 0;
    }
    if (put(e, h, hn) == 0 && put(e, s, (size_t)n) == 0)
        rc = 0;
    e->framing = 1;
    Py_XDECREF(tmp);
    return rc == 0 ? memo_put_if_shared(e, o) : ERR;
}

/* ---- containers ------------------------------------------------------- */

/* Encode o while holding a reference of our own (see `shared`). */
static int enc_held(enc *e, PyObject *o)
{
    int rc;
    Py_INCREF(o);
    rc = enc_obj(e, o);
    Py_DECREF(o);
    return rc;
}

static int enc_tuple(enc *e, PyObject *o)
{
    static const char small[] = {')', (char)0x85, (char)0x86, (char)0x87};
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    if (n == 0)
        return put1(e, ')'); /* EMPTY_TUPLE, never memoized */
    if (n > 3 && put1(e, '(') < 0)
        return ERR;
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = enc_held(e, PyTuple_GET_ITEM(o, i));
        if (rc < 0)
            return rc;
    }
    /* Memoized while its items were written: the tuple contains itself
     * through a list or dict.  The pickler has a special form for that;
     * leave it to the pickler. */
    if (memo_find(e, o) >= 0)
        return UNSUP;
    if (put1(e, n > 3 ? 't' : small[n]) < 0)
        return ERR;
    return memo_put_if_shared(e, o);
}

static int enc_list(enc *e, PyObject *o)
{
    Py_ssize_t i = 0, n;
    if (put1(e, ']') < 0 || memo_put_if_shared(e, o) < 0)
        return ERR;
    if (PyList_GET_SIZE(o) == 1) {
        int rc = enc_held(e, PyList_GET_ITEM(o, 0));
        return rc < 0 ? rc : put1(e, 'a'); /* APPEND */
    }
    while (i < PyList_GET_SIZE(o)) {
        if (put1(e, '(') < 0)
            return ERR;
        for (n = 0; n < BATCH && i < PyList_GET_SIZE(o); n++, i++) {
            int rc = enc_held(e, PyList_GET_ITEM(o, i));
            if (rc < 0)
                return rc;
        }
        if (put1(e, 'e') < 0) /* APPENDS */
            return ERR;
    }
    return 0;
}

/* Both held before either is written: writing the key may run Python code
 * (a reduction) that changes the dict and drops the value. */
static int enc_item(enc *e, PyObject *k, PyObject *v)
{
    int rc;
    Py_INCREF(k);
    Py_INCREF(v);
    rc = enc_obj(e, k);
    if (rc == 0)
        rc = enc_obj(e, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return rc;
}

static int enc_dict(enc *e, PyObject *o)
{
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(o), n;
    PyObject *k, *v;
    if (put1(e, '}') < 0 || memo_put_if_shared(e, o) < 0)
        return ERR;
    if (size == 0)
        return 0;
    if (size == 1 && PyDict_Next(o, &pos, &k, &v)) {
        int rc = enc_item(e, k, v);
        return rc < 0 ? rc : put1(e, 's'); /* SETITEM */
    }
    for (Py_ssize_t done = 0; done < size; done += n) {
        if (put1(e, '(') < 0)
            return ERR;
        for (n = 0; n < BATCH && PyDict_Next(o, &pos, &k, &v); n++) {
            int rc = enc_item(e, k, v);
            if (rc < 0)
                return rc;
            if (PyDict_GET_SIZE(o) != size) {
                PyErr_SetString(PyExc_RuntimeError,
                                "dictionary changed size during iteration");
                return ERR;
            }
        }
        if (put1(e, 'u') < 0) /* SETITEMS */
            return ERR;
        if (n == 0)
            break;
    }
    return 0;
}

/* ---- globals and objects ---------------------------------------------- */

/* The pickler's save_global (Modules/_pickle.c): module and qualified
 * name as STACK_GLOBAL, after checking that importing them gives back this
 * very object (else the pickler raises, so leave it to the pickler). */
static int enc_global(enc *e, PyObject *obj, PyObject *name)
{
    PyObject *module = NULL, *qual = NULL, *parts = NULL, *cur = NULL;
    int rc = UNSUP;
    long idx = memo_find(e, obj);
    if (idx >= 0)
        return put_get(e, idx);
    module = PyObject_GetAttrString(obj, "__module__");
    if (module == NULL || !PyUnicode_CheckExact(module))
        goto done;
    if (name != NULL) {
        Py_INCREF(name);
        qual = name;
    }
    else if ((qual = PyObject_GetAttrString(obj, "__qualname__")) == NULL)
        goto done;
    if (!PyUnicode_CheckExact(qual))
        goto done;
    parts = PyObject_CallMethod(qual, "split", "s", ".");
    if (parts == NULL || (cur = PyImport_Import(module)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parts); i++) {
        PyObject *next = PyObject_GetAttr(cur, PyList_GET_ITEM(parts, i));
        Py_DECREF(cur);
        cur = next;
        if (cur == NULL)
            goto done;
    }
    if (cur != obj)
        goto done;
    if (enc_obj(e, module) < 0 || enc_obj(e, qual) < 0
        || put1(e, (char)0x93) < 0 /* STACK_GLOBAL */
        || memo_put(e, obj) < 0)
        rc = ERR;
    else
        rc = 0;
done:
    if (rc == UNSUP)
        PyErr_Clear(); /* a failed import or lookup: the pickler's to report */
    Py_XDECREF(module);
    Py_XDECREF(qual);
    Py_XDECREF(parts);
    Py_XDECREF(cur);
    return rc;
}

/* cls.__new__(cls) as copyreg.__newobj__ pickles it: the class, an empty
 * argument tuple, NEWOBJ; memoized before the state, as the pickler does,
 * so that the state may refer back to the object. */
static int enc_newobj(enc *e, PyObject *o)
{
    int rc = enc_global(e, (PyObject *)Py_TYPE(o), NULL);
    if (rc < 0)
        return rc;
    if (put(e, ")\x81", 2) < 0) /* EMPTY_TUPLE NEWOBJ */
        return ERR;
    return memo_put_if_shared(e, o);
}

/* The state and BUILD; a None state writes nothing (save_reduce). */
static int enc_state(enc *e, PyObject *state)
{
    int rc;
    if (state == Py_None)
        return 0;
    rc = enc_obj(e, state);
    return rc < 0 ? rc : put1(e, 'b'); /* BUILD */
}

static int enc_plain(enc *e, PyObject *o)
{
    PyObject *d;
    int rc = enc_newobj(e, o);
    if (rc < 0)
        return rc;
    d = PyObject_GenericGetDict(o, NULL);
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return ERR;
        PyErr_Clear();
        return UNSUP;
    }
    /* object.__getstate__: the instance dict, or None when it is empty. */
    rc = PyDict_CheckExact(d) ? enc_state(e, PyDict_GET_SIZE(d) ? d : Py_None)
                              : UNSUP;
    Py_DECREF(d);
    return rc;
}

static int enc_getstate(enc *e, PyObject *o)
{
    PyObject *state;
    int rc = enc_newobj(e, o);
    if (rc < 0)
        return rc;
    state = PyObject_CallMethod(o, "__getstate__", NULL);
    if (state == NULL)
        return ERR;
    rc = enc_state(e, state);
    Py_DECREF(state);
    return rc;
}

/* dcpx's reducer_override (dcpx/formats/metadata.py): _StorageInfo(path, offset,
 * length) when it has no transform descriptors; torch's __getstate__ when
 * it has. */
static int enc_storage(enc *e, PyObject *o)
{
    PyObject *td = PyObject_GetAttr(o, e->names[3]);
    int rc;
    if (td == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return ERR;
        PyErr_Clear();
    }
    else if (td != Py_None) {
        Py_DECREF(td);
        return enc_getstate(e, o);
    }
    Py_XDECREF(td);
    rc = enc_global(e, (PyObject *)Py_TYPE(o), NULL);
    for (int i = 0; rc == 0 && i < 3; i++) {
        PyObject *v = PyObject_GetAttr(o, e->names[i]);
        rc = v == NULL ? ERR : enc_obj(e, v);
        Py_XDECREF(v);
    }
    if (rc < 0)
        return rc;
    if (put(e, "\x87R", 2) < 0) /* TUPLE3 REDUCE */
        return ERR;
    return memo_put_if_shared(e, o);
}

/* torch.Size.__reduce_ex__: (torch.Size, (tuple(self),)). */
static int enc_size(enc *e, PyObject *o)
{
    static const char tup[] = {')', (char)0x85, (char)0x86, (char)0x87};
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    int rc = enc_global(e, (PyObject *)Py_TYPE(o), NULL);
    if (rc < 0)
        return rc;
    if (n > 3 && put1(e, '(') < 0)
        return ERR;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(o, i);
        if (!PyLong_CheckExact(v))
            return UNSUP;
        if (enc_int(e, v) < 0)
            return ERR;
    }
    if (put1(e, n > 3 ? 't' : tup[n]) < 0 || put(e, "\x85R", 2) < 0)
        return ERR; /* TUPLE1 REDUCE */
    return memo_put_if_shared(e, o);
}

/* save_reduce for what singletons reduce to: a global name, or
 * (callable, args) with a class or function as the callable. */
static int enc_reduce(enc *e, PyObject *o, PyObject *reducer)
{
    PyObject *rv, *fn, *args;
    int rc = UNSUP;
    if (reducer != Py_None)
        rv = PyObject_CallFunctionObjArgs(reducer, o, NULL);
    else
        rv = PyObject_CallMethod(o, "__reduce_ex__", "O", e->proto);
    if (rv == NULL)
        return ERR;
    if (PyUnicode_Check(rv)) {
        rc = enc_global(e, o, rv);
        goto done;
    }
    if (!PyTuple_CheckExact(rv) || PyTuple_GET_SIZE(rv) != 2)
        goto done;
    fn = PyTuple_GET_ITEM(rv, 0);
    args = PyTuple_GET_ITEM(rv, 1);
    /* copyreg.__newobj__ and friends would be NEWOBJ: not handled here. */
    if (!PyTuple_CheckExact(args) || !(PyType_Check(fn) || PyFunction_Check(fn)))
        goto done;
    if (PyFunction_Check(fn)) {
        PyObject *fname = PyObject_GetAttrString(fn, "__name__");
        int newobj = fname == NULL || !PyUnicode_Check(fname)
                     || PyUnicode_CompareWithASCIIString(fname, "__newobj__") == 0
                     || PyUnicode_CompareWithASCIIString(fname, "__newobj_ex__") == 0;
        PyErr_Clear();
        Py_XDECREF(fname);
        if (newobj)
            goto done;
    }
    rc = enc_global(e, fn, NULL);
    if (rc == 0)
        rc = enc_obj(e, args);
    if (rc == 0)
        rc = put1(e, 'R') < 0 ? ERR : 0;
    /* Memoized while its arguments were written: it contains itself, which
     * the pickler writes in a form of its own. */
    if (rc == 0)
        rc = memo_find(e, o) >= 0 ? UNSUP : memo_put_if_shared(e, o);
done:
    Py_DECREF(rv);
    return rc;
}

static int enc_instance(enc *e, PyObject *o)
{
    PyObject *spec = PyDict_GetItemWithError(e->kinds, (PyObject *)Py_TYPE(o));
    long kind;
    if (spec == NULL)
        return PyErr_Occurred() ? ERR : UNSUP;
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2) {
        PyErr_SetString(PyExc_TypeError, "dcpx: dump_metadata: kinds values are (kind, reducer)");
        return ERR;
    }
    kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
    switch (kind) {
    case KIND_PLAIN: return enc_plain(e, o);
    case KIND_GETSTATE: return enc_getstate(e, o);
    case KIND_STORAGE: return enc_storage(e, o);
    case KIND_SIZE:
        return PyTuple_Check(o) ? enc_size(e, o) : UNSUP;
    case KIND_REDUCE: return enc_reduce(e, o, PyTuple_GET_ITEM(spec, 1));
    default:
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "dcpx: dump_metadata: unknown kind");
        return ERR;
    }
}

static int enc_ref(enc *e, PyObject *o);

static int enc_obj(enc *e, PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    int rc;
    if (o == Py_None)
        rc = put1(e, 'N');
    else if (o == Py_True || o == Py_False)
        rc = put1(e, o == Py_True ? (char)0x88 : (char)0x89);
    else if (t == &PyLong_Type)
        rc = enc_int(e, o);
    else if (t == &PyFloat_Type)
        rc = enc_float(e, o);
    else
        return enc_ref(e, o);
    if (rc == 0)
        boundary(e);
    return rc;
}

/* Objects the pickler memoizes (everything but the atoms above). */
static int enc_ref(enc *e, PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    long idx;
    int rc;
    /* A memoized object has the memo's reference besides its holder's and
     * ours: an unshared one cannot be in the memo. */
    idx = shared(o) ? memo_find(e, o) : -1;
    if (idx >= 0)
        return put_get(e, idx);
    if (Py_EnterRecursiveCall(" while encoding DCP metadata"))
        return ERR;
    if (t == &PyUnicode_Type)
        rc = enc_str(e, o);
    else if (t == &PyTuple_Type)
        rc = enc_tuple(e, o);
    else if (t == &PyList_Type)
        rc = enc_list(e, o);
    else if (t == &PyDict_Type)
        rc = enc_dict(e, o);
    else
        rc = enc_instance(e, o);
    Py_LeaveRecursiveCall();
    if (rc == 0)
        boundary(e);
    return rc;
}

/* The split form (names given): the stream is
 *
 *   PROTO | names: each str, MEMOIZE, POP (memo 0 .. n-1) | obj (whose
 *   BUILD leaves it on the stack) | tail, BUILD | STOP
 *
 * each part in frames of its own.  obj refers to a name by its memo index
 * only (the names are memoized before it, and an object is looked up in
 * the memo by identity), and the tail, a second state for obj (BUILD
 * updates the instance dict), is written without the memo: so the bytes of
 * obj do not depend on the names' text or on the tail, and a caller that
 * has them from an earlier call with as many names passes them as
 * `middle` instead of encoding obj again (dcpx/formats/metadata.py, "Reuse of the
 * encoded body"). */
static int enc_names(enc *e, PyObject *names)
{
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(names, i);
        int rc;
        if (!PyUnicode_CheckExact(s)) {
            PyErr_SetString(PyExc_TypeError, "dcpx: dump_metadata: names must be str");
            return ERR;
        }
        if (memo_find(e, s) >= 0) {
            PyErr_SetString(PyExc_ValueError, "dcpx: dump_metadata: a name is given twice");
            return ERR;
        }
        /* enc_str memoizes only what is shared: this one must be. */
        rc = enc_str(e, s);
        if (rc < 0)
            return rc;
        if (memo_find(e, s) < 0 && memo_put(e, s) < 0)
            return ERR;
        if (put1(e, '0') < 0) /* POP */
            return ERR;
    }
    commit_frame(e);
    return 0;
}

/* Append bytes already encoded (complete frames) outside any frame. */
static int put_raw(enc *e, PyObject *b)
{
    int rc;
    commit_frame(e);
    e->framing = 0;
    rc = put(e, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b));
    e->framing = 1;
    return rc;
}

PyObject *dcpx_dump_metadata(PyObject *Py_UNUSED(module), PyObject *args,
                             PyObject *kwds)
{
    static char *kwlist[] = {"metadata", "kinds", "protocol", "names", "tail",
                             "middle", NULL};
    enc e;
    PyObject *obj, *kinds, *out = NULL, *names = Py_None, *tail = Py_None;
    PyObject *middle = Py_None;
    int proto, rc;
    size_t mark0 = 0, mark1 = 0;
    unsigned char head[2];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!i|O!OO:dump_metadata", kwlist,
                                     &obj, &PyDict_Type, &kinds, &proto,
                                     &PyTuple_Type, &names, &tail, &middle))
        return NULL;
    if (proto < 4 || proto > 5) {
        PyErr_SetString(PyExc_ValueError, "dcpx: dump_metadata writes protocol 4 or 5");
        return NULL;
    }
    if (names == Py_None && (tail != Py_None || middle != Py_None)) {
        PyErr_SetString(PyExc_TypeError, "dcpx: dump_metadata: tail and middle "
                        "need names (the split form)");
        return NULL;
    }
    if (middle != Py_None && !PyBytes_CheckExact(middle)) {
        PyErr_SetString(PyExc_TypeError, "dcpx: dump_metadata: middle must be bytes");
        return NULL;
    }
    memset(&e, 0, sizeof(e));
    e.frame_start = -1;
    e.kinds = kinds;
    e.proto = PyLong_FromLong(proto);
    head[0] = 0x80; /* PROTO, before the first frame */
    head[1] = (unsigned char)proto;
    rc = e.proto == NULL || memo_grow(&e) < 0 ? ERR : put(&e, head, 2);
    for (int i = 0; rc == 0 && i < 4; i++)
        if ((e.names[i] = PyUnicode_InternFromString(storage_names[i])) == NULL)
            rc = ERR;
    e.framing = 1;
    if (rc == 0 && names != Py_None) {
        rc = enc_names(&e, names);
        mark0 = e.len;
    }
    if (rc == 0)
        rc = middle != Py_None ? put_raw(&e, middle) : enc_obj(&e, obj);
    if (rc == 0 && names != Py_None) {
        commit_frame(&e);
        mark1 = e.len;
        if (tail != Py_None) {
            e.nomemo = 1;
            rc = enc_obj(&e, tail);
            if (rc == 0)
                rc = put1(&e, 'b'); /* BUILD */
            e.nomemo = 0;
        }
    }
    if (rc == 0)
        rc = put1(&e, '.');
    commit_frame(&e);
    if (rc == 0) {
        out = PyBytes_FromStringAndSize(e.buf, (Py_ssize_t)e.len);
        if (out != NULL && names != Py_None) {
            PyObject *t = Py_BuildValue("(Nnn)", out, (Py_ssize_t)mark0,
                                        (Py_ssize_t)mark1);
            out = t;
        }
    }
    else if (rc == UNSUP || PyErr_ExceptionMatches(PyExc_RecursionError)) {
        /* Python's pickler decides: it writes the stream, or raises. */
        PyErr_Clear();
        Py_INCREF(Py_None);
        out = Py_None;
    }
    for (size_t i = 0; i < e.memo_cap; i++)
        Py_XDECREF(e.memo[i].key);
    PyMem_Free(e.memo);
    PyMem_Free(e.buf);
    Py_XDECREF(e.proto);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(e.names[i]);
    return out;
}
