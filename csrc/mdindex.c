/* md_index: a .metadata pickle decoded straight into the tables a load
 * needs, without building its ~20 Python objects per tensor.
 *
 *   (index, files) = md_index(data, body_len, globals, dtypes)   or None
 *       data[:body_len]: the pickle; globals: {(module, name): (kind, i)}
 *       for the globals it may name (dcpx/formats/metadata.py, _index_tables);
 *       dtypes[i] = (torch.dtype, storage type name or None).  files: the
 *       data files the storage entries name, each once.
 *   ok = md_index_check(index, sizes)      sizes[f]: bytes of files[f], or
 *                                          None: files[f] not checked (a
 *                                          load checks only the files it reads)
 *   d  = md_index_bytes(index, cls)        {fqn: cls(path, offset, length)}
 *                                          for entries without an offset
 *
 * md_index answers None for anything it does not fully understand, and
 * then the caller takes the general path (torch's Unpickler under the
 * allow-list, _metadata._validate, FileSystemReader._validate_storage),
 * which raises the precise error.  So it accepts only a subset of what
 * that path accepts, with the same meaning:
 *  - a small pickle machine over plain C values (no Python object is made
 *    from the checkpoint's contents): the opcodes protocol 2..5 picklers
 *    write for DCP metadata (PROTO, FRAME, MARK, tuples, lists, dicts,
 *    memo, ints of at most 8 bytes, ASCII strings, STACK_GLOBAL, NEWOBJ,
 *    REDUCE, BUILD, POP, STOP; frames that tile the pickle exactly; the
 *    split form of dcpx's own saves,
 *    docs/format.md: memoized names popped, and a second BUILD of the
 *    Metadata with a dict whose keys the first did not set); any other opcode, a stack underflow past a
 *    mark, a memo index larger than the pickle, data after STOP: None;
 *  - globals only from `globals` (a subset of the Unpickler's allow-list),
 *    each used only the way a pickler writes it: classes through NEWOBJ
 *    with no arguments then one BUILD (a dict state; TensorProperties'
 *    __setstate__ 5-tuple), torch.Size / _StorageInfo / _get_layout /
 *    _MEM_FORMAT_ENCODING / paths through REDUCE with typed arguments;
 *  - a dict used as a BUILD state may not change afterwards (Python copies
 *    it into the object at BUILD); dict keys must be hashable for sure;
 *  - after STOP, the Metadata graph is checked as _metadata._validate and
 *    _validate_storage check it (types, chunk bounds, data file names,
 *    non-negative extents; extents against file sizes in md_index_check),
 *    and duplicate keys make it None.
 * Then, per state dict key: tensor or bytes, dtype, size, and the storage
 * entry of its whole single chunk (as _readplan.Checkpoint.whole_chunks
 * finds it); per storage entry: file, offset, length.  read_plan_md
 * (reader.c) plans a load from it.
 */
#include "dcpx.h"

#include <stdlib.h>
#include <string.h>

enum {
    V_NONE, V_BOOL, V_INT, V_STR, V_TUPLE, V_LIST, V_DICT, V_CLASS, V_OBJ,
    V_SIZE, V_DTYPE, V_LAYOUT, V_MEMFMT, V_PATH, V_OPAQUE
};

/* Global kinds (dcpx/formats/metadata.py _index_tables uses the same numbers). */
enum {
    G_METADATA = 1, G_TSM, G_BSM, G_CSM, G_TP, G_MI, G_SMETA, G_SI,
    G_SIZE, G_GET_LAYOUT, G_MEMFMT_ENC, G_PATH, G_DTYPE, G_OPAQUE
};

typedef struct {
    uint32_t start, count;
    int32_t next;
} seg;

typedef struct {
    uint8_t tag;
    uint8_t kind;      /* V_CLASS, V_OBJ: G_* */
    uint8_t frozen;    /* V_DICT: a BUILD state; V_OBJ: built */
    uint8_t reduced;   /* V_OBJ(G_SI): made by REDUCE, state = args */
    int32_t state;     /* V_OBJ: state value, -1 none; V_SIZE: its tuple */
    int32_t state2;    /* V_OBJ(G_METADATA): a second BUILD's dict (the
                        * split form's storage_meta), -1 none */
    int32_t head, tail;/* containers: first / last segment, -1 if none */
    uint32_t count;    /* containers: items (a dict: 2 per pair) */
    uint32_t len;      /* V_STR */
    int64_t num;       /* V_INT, V_BOOL, V_MEMFMT; V_DTYPE: index;
                        * V_STR: offset in the data */
} val;

typedef struct {
    const unsigned char *p;
    size_t n;
    val *v;
    uint32_t nv, cv;
    seg *s;
    uint32_t ns, cs;
    uint32_t *refs;
    uint32_t nr, cr;
    uint32_t *stack;
    uint32_t sp, cstack;
    uint32_t *marks;
    uint32_t nm, cm;
    int32_t *memo;
    uint32_t nmemo, memo_len;
    PyObject *globals;
    int proto;
    /* per field-name list: the string value last found to be each name
     * (keys are memoized strings: one compare of indices, mostly) */
    uint32_t nc_md[5], nc_sm[4], nc_tsm[3], nc_csm[2], nc_mi[3], nc_si[4];
} vm;

#define GROW(arr, cnt, cap, extra)                                          \
    do {                                                                    \
        if ((size_t)(cnt) + (extra) > (cap)) {                              \
            size_t nc_ = (size_t)(cap) * 2 + (extra) + 64;                  \
            if (nc_ > 0xffffffffu)                                          \
                nc_ = 0xffffffffu;                                          \
            if (nc_ < (size_t)(cnt) + (extra))                              \
                return -1;             /* more than 2**32 entries */        \
            void *g_ = realloc((arr), nc_ * sizeof(*(arr)));                \
            if (g_ == NULL)                                                 \
                return -2;                                                  \
            (arr) = g_;                                                     \
            (cap) = (uint32_t)nc_;                                          \
        }                                                                   \
    } while (0)

/* Return codes inside: 0 ok, -1 not understood (None), -2 no memory. */

static int newval(vm *m, int tag, uint32_t *out)
{
    if (m->nv >= 0x7fffffffu)
        return -1;
    GROW(m->v, m->nv, m->cv, 1);
    val *x = &m->v[m->nv];
    memset(x, 0, sizeof(*x));
    x->tag = (uint8_t)tag;
    x->state = x->state2 = x->head = x->tail = -1;
    *out = m->nv++;
    return 0;
}

static int push(vm *m, uint32_t i)
{
    GROW(m->stack, m->sp, m->cstack, 1);
    m->stack[m->sp++] = i;
    return 0;
}

static uint32_t fence(const vm *m)
{
    return m->nm ? m->marks[m->nm - 1] : 0;
}

/* Append stack[from .. sp) to container c as one segment. */
static int add_items(vm *m, uint32_t c, uint32_t from)
{
    uint32_t k = m->sp - from;
    if (k == 0)
        return 0;
    GROW(m->refs, m->nr, m->cr, k);
    GROW(m->s, m->ns, m->cs, 1);
    seg *g = &m->s[m->ns];
    g->start = m->nr;
    g->count = k;
    g->next = -1;
    memcpy(m->refs + m->nr, m->stack + from, sizeof(uint32_t) * k);
    m->nr += k;
    val *x = &m->v[c];
    if (x->tail >= 0)
        m->s[x->tail].next = (int32_t)m->ns;
    else
        x->head = (int32_t)m->ns;
    x->tail = (int32_t)m->ns;
    x->count += k;
    m->ns++;
    return 0;
}

/* Item i of a container whose items are one segment (a tuple). */
static uint32_t item(const vm *m, const val *x, uint32_t i)
{
    return m->refs[m->s[x->head].start + i];
}

static int64_t sle(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    if (n > 0 && n < 8 && (p[n - 1] & 0x80))
        v |= ~(uint64_t)0 << (8 * n);
    return (int64_t)v;
}

static int str_is(const vm *m, const val *x, const char *s)
{
    size_t l = strlen(s);
    return x->tag == V_STR && x->len == l && memcmp(m->p + x->num, s, l) == 0;
}

/* A value Python can certainly hash (as a dict key). */
static int hashable(const vm *m, uint32_t i);

static int mi_valid(const vm *m, const val *x);

static int hashable(const vm *m, uint32_t i)
{
    const val *x = &m->v[i];
    switch (x->tag) {
    case V_NONE: case V_BOOL: case V_INT: case V_STR:
        return 1;
    case V_TUPLE:
        for (uint32_t k = 0; k < x->count; k++) {
            int t = m->v[item(m, x, k)].tag;
            if (t != V_NONE && t != V_BOOL && t != V_INT && t != V_STR)
                return 0;
        }
        return 1;
    case V_OBJ:
        return x->kind == G_MI && x->frozen && mi_valid(m, x);
    default:
        return 0;
    }
}

static int pop_to_tuple(vm *m, uint32_t from)
{
    uint32_t t;
    int rc = newval(m, V_TUPLE, &t);
    if (rc < 0 || (rc = add_items(m, t, from)) < 0)
        return rc;
    m->sp = from;
    return push(m, t);
}

static int resolve_global(vm *m, uint32_t mod, uint32_t name, uint32_t *out)
{
    const val *a = &m->v[mod], *b = &m->v[name];
    if (a->tag != V_STR || b->tag != V_STR)
        return -1;
    PyObject *key = Py_BuildValue("(s#s#)", (const char *)m->p + a->num,
                                  (Py_ssize_t)a->len, (const char *)m->p + b->num,
                                  (Py_ssize_t)b->len);
    if (key == NULL) {
        PyErr_Clear();
        return -1;
    }
    PyObject *hit = PyDict_GetItemWithError(m->globals, key);
    Py_DECREF(key);
    if (hit == NULL) {
        PyErr_Clear();
        return -1;
    }
    long kind, idx;
    if (!PyArg_ParseTuple(hit, "ll", &kind, &idx)) {
        PyErr_Clear();
        return -1;
    }
    uint32_t g;
    int rc;
    if (kind == G_DTYPE) {
        if ((rc = newval(m, V_DTYPE, &g)) < 0)
            return rc;
        m->v[g].num = idx;
    }
    else if (kind == G_OPAQUE) {
        if ((rc = newval(m, V_OPAQUE, &g)) < 0)
            return rc;
    }
    else if (kind >= G_METADATA && kind <= G_PATH) {
        if ((rc = newval(m, V_CLASS, &g)) < 0)
            return rc;
        m->v[g].kind = (uint8_t)kind;
    }
    else {
        return -1;
    }
    *out = g;
    return 0;
}

/* REDUCE callable(*args) for the callables this machine knows. */
static int reduce(vm *m, uint32_t fn, uint32_t args, uint32_t *out)
{
    const val *f = &m->v[fn], *a = &m->v[args];
    uint32_t r;
    int rc;
    if (f->tag != V_CLASS || a->tag != V_TUPLE)
        return -1;
    switch (f->kind) {
    case G_SIZE: {
        if (a->count != 1)
            return -1;
        uint32_t t = item(m, a, 0);
        const val *tv = &m->v[t];
        if (tv->tag != V_TUPLE)
            return -1;
        for (uint32_t k = 0; k < tv->count; k++)
            if (m->v[item(m, tv, k)].tag != V_INT)
                return -1;
        if ((rc = newval(m, V_SIZE, &r)) < 0)
            return rc;
        m->v[r].state = (int32_t)t;
        break;
    }
    case G_GET_LAYOUT:
        if (a->count != 1 || !str_is(m, &m->v[item(m, a, 0)], "torch.strided"))
            return -1;
        if ((rc = newval(m, V_LAYOUT, &r)) < 0)
            return rc;
        break;
    case G_MEMFMT_ENC: {
        if (a->count != 1)
            return -1;
        const val *e = &m->v[item(m, a, 0)];
        if (e->tag != V_INT || e->num < 0 || e->num > 2)
            return -1;
        if ((rc = newval(m, V_MEMFMT, &r)) < 0)
            return rc;
        m->v[r].num = m->v[item(m, a, 0)].num;
        break;
    }
    case G_PATH:
        for (uint32_t k = 0; k < a->count; k++)
            if (m->v[item(m, a, k)].tag != V_STR)
                return -1;
        if ((rc = newval(m, V_PATH, &r)) < 0)
            return rc;
        break;
    case G_SI:
        if (a->count != 3 || m->v[item(m, a, 0)].tag != V_STR ||
            m->v[item(m, a, 1)].tag != V_INT || m->v[item(m, a, 2)].tag != V_INT)
            return -1;
        if ((rc = newval(m, V_OBJ, &r)) < 0)
            return rc;
        m->v[r].kind = G_SI;
        m->v[r].reduced = 1;
        m->v[r].frozen = 1;
        m->v[r].state = (int32_t)args;
        break;
    default:
        return -1;
    }
    *out = r;
    return 0;
}

static int run(vm *m)
{
    const unsigned char *p = m->p;
    size_t n = m->n, i = 0;
    size_t frame_end = 0; /* where the current frame ends, 0: no frame yet */
    while (i < n) {
        /* Frames tile the pickle from the first one on: no opcode crosses a
         * frame's end, and one that ends is followed by the next FRAME (a
         * reader from a file reads frame by frame; one from bytes ignores
         * the lengths: only then do both read the same). */
        if (frame_end != 0 && (i > frame_end || (i == frame_end && p[i] != 0x95)))
            return -1;
        unsigned char op = p[i++];
        uint32_t x, y, z;
        int rc;
        size_t need = 0;
        switch (op) {
        case 'K': case 'h': case 'q': case 0x80: case 0x8c: case 0x8a: need = 1; break;
        case 'M': need = 2; break;
        case 'J': case 'j': case 'r': case 'X': need = 4; break;
        case 0x95: need = 8; break;
        default: break;
        }
        if (n - i < need)
            return -1;
        switch (op) {
        case 0x80: /* PROTO */
            if (p[i] > 5)
                return -1;
            m->proto = p[i];
            i += 1;
            break;
        case 0x95: { /* FRAME */
            uint64_t fl = (uint64_t)sle(p + i, 8);
            if (frame_end != 0 && i - 1 != frame_end)
                return -1; /* a frame inside a frame */
            i += 8;
            if (fl > n - i)
                return -1;
            frame_end = i + (size_t)fl;
            break;
        }
        case '.': /* STOP */
            if (i != n || m->sp != 1 || m->nm != 0 || (frame_end != 0 && i != frame_end))
                return -1;
            return 0;
        case '(':
            GROW(m->marks, m->nm, m->cm, 1);
            m->marks[m->nm++] = m->sp;
            break;
        case ')':
            if ((rc = newval(m, V_TUPLE, &x)) < 0 || (rc = push(m, x)) < 0)
                return rc;
            break;
        case 0x85: case 0x86: case 0x87: { /* TUPLE1..3 */
            uint32_t k = (uint32_t)(op - 0x84);
            if (m->sp < fence(m) + k)
                return -1;
            if ((rc = pop_to_tuple(m, m->sp - k)) < 0)
                return rc;
            break;
        }
        case 't': {
            if (m->nm == 0)
                return -1;
            uint32_t from = m->marks[--m->nm];
            if ((rc = pop_to_tuple(m, from)) < 0)
                return rc;
            break;
        }
        case ']':
            if ((rc = newval(m, V_LIST, &x)) < 0 || (rc = push(m, x)) < 0)
                return rc;
            break;
        case '}':
            if ((rc = newval(m, V_DICT, &x)) < 0 || (rc = push(m, x)) < 0)
                return rc;
            break;
        case 'a': /* APPEND */
            if (m->sp < fence(m) + 2 || m->v[m->stack[m->sp - 2]].tag != V_LIST)
                return -1;
            if ((rc = add_items(m, m->stack[m->sp - 2], m->sp - 1)) < 0)
                return rc;
            m->sp--;
            break;
        case 'e': { /* APPENDS */
            if (m->nm == 0)
                return -1;
            uint32_t from = m->marks[--m->nm];
            if (from < fence(m) + 1 || m->v[m->stack[from - 1]].tag != V_LIST)
                return -1;
            if ((rc = add_items(m, m->stack[from - 1], from)) < 0)
                return rc;
            m->sp = from;
            break;
        }
        case 's': case 'u': { /* SETITEM, SETITEMS */
            uint32_t from;
            if (op == 's') {
                if (m->sp < fence(m) + 3)
                    return -1;
                from = m->sp - 2;
            }
            else {
                if (m->nm == 0)
                    return -1;
                from = m->marks[--m->nm];
                if (from < fence(m) + 1 || (m->sp - from) % 2)
                    return -1;
            }
            val *d = &m->v[m->stack[from - 1]];
            if (d->tag != V_DICT || d->frozen)
                return -1;
            for (uint32_t k = from; k < m->sp; k += 2)
                if (!hashable(m, m->stack[k]))
                    return -1;
            if ((rc = add_items(m, m->stack[from - 1], from)) < 0)
                return rc;
            m->sp = from;
            break;
        }
        case 'N': case 0x88: case 0x89:
            if ((rc = newval(m, op == 'N' ? V_NONE : V_BOOL, &x)) < 0)
                return rc;
            m->v[x].num = op == 0x88;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        case 'K': case 'M': case 'J': case 0x8a: {
            int64_t num;
            if (op == 'K') {
                num = p[i];
                i += 1;
            }
            else if (op == 'M') {
                num = p[i] | (p[i + 1] << 8);
                i += 2;
            }
            else if (op == 'J') {
                num = sle(p + i, 4);
                i += 4;
            }
            else {
                size_t l = p[i++];
                if (l > 8 || n - i < l)
                    return -1;
                num = sle(p + i, (int)l);
                i += l;
            }
            if ((rc = newval(m, V_INT, &x)) < 0)
                return rc;
            m->v[x].num = num;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        }
        case 0x8c: case 'X': { /* SHORT_BINUNICODE, BINUNICODE */
            size_t l = op == 0x8c ? p[i] : (size_t)(uint32_t)sle(p + i, 4);
            i += op == 0x8c ? 1 : 4;
            if (l > n - i || l > 0x7fffffff)
                return -1;
            for (size_t k = 0; k < l; k++)
                if (p[i + k] & 0x80)  /* ASCII only; the rest: Python */
                    return -1;
            if ((rc = newval(m, V_STR, &x)) < 0)
                return rc;
            m->v[x].num = (int64_t)i;
            m->v[x].len = (uint32_t)l;
            i += l;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        }
        case 0x94: case 'q': case 'r': { /* MEMOIZE, BINPUT, LONG_BINPUT */
            uint64_t idx;
            if (op == 0x94) {
                idx = m->memo_len;
            }
            else if (op == 'q') {
                idx = p[i];
                i += 1;
            }
            else {
                idx = (uint32_t)sle(p + i, 4);
                i += 4;
            }
            if (m->sp <= fence(m) || idx > n)
                return -1;
            if (idx >= m->nmemo) {
                uint32_t want = (uint32_t)idx + 1, c = m->nmemo;
                uint32_t nc = want > 2 * c + 64 ? want : 2 * c + 64;
                int32_t *g = realloc(m->memo, sizeof(int32_t) * nc);
                if (g == NULL)
                    return -2;
                for (uint32_t k = c; k < nc; k++)
                    g[k] = -1;
                m->memo = g;
                m->nmemo = nc;
            }
            if (m->memo[idx] < 0)
                m->memo_len++;
            m->memo[idx] = (int32_t)m->stack[m->sp - 1];
            break;
        }
        case 'h': case 'j': { /* BINGET, LONG_BINGET */
            uint64_t idx;
            if (op == 'h') {
                idx = p[i];
                i += 1;
            }
            else {
                idx = (uint32_t)sle(p + i, 4);
                i += 4;
            }
            if (idx >= m->nmemo || m->memo[idx] < 0)
                return -1;
            if ((rc = push(m, (uint32_t)m->memo[idx])) < 0)
                return rc;
            break;
        }
        case 0x93: /* STACK_GLOBAL */
            if (m->proto < 4 || m->sp < fence(m) + 2)
                return -1;
            if ((rc = resolve_global(m, m->stack[m->sp - 2], m->stack[m->sp - 1], &x)) < 0)
                return rc;
            m->sp -= 2;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        case 0x81: { /* NEWOBJ */
            if (m->sp < fence(m) + 2)
                return -1;
            const val *c = &m->v[m->stack[m->sp - 2]], *a = &m->v[m->stack[m->sp - 1]];
            if (c->tag != V_CLASS || c->kind > G_SI || a->tag != V_TUPLE || a->count)
                return -1;
            uint8_t kind = c->kind;
            if ((rc = newval(m, V_OBJ, &x)) < 0)
                return rc;
            m->v[x].kind = kind;
            m->sp -= 2;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        }
        case 'R': /* REDUCE */
            if (m->sp < fence(m) + 2)
                return -1;
            if ((rc = reduce(m, m->stack[m->sp - 2], m->stack[m->sp - 1], &x)) < 0)
                return rc;
            m->sp -= 2;
            if ((rc = push(m, x)) < 0)
                return rc;
            break;
        case '0': /* POP: the split form's memoized file names */
            if (m->sp <= fence(m))
                return -1;
            m->sp--;
            break;
        case 'b': { /* BUILD */
            if (m->sp < fence(m) + 2)
                return -1;
            y = m->stack[m->sp - 1];
            z = m->stack[m->sp - 2];
            val *o = &m->v[z], *st = &m->v[y];
            if (o->tag == V_OBJ && o->frozen && o->kind == G_METADATA &&
                o->state2 < 0 && st->tag == V_DICT) {
                /* the split form's second BUILD (docs/format.md): its keys
                 * join the first state's; a key in both is left to
                 * Python (fields() refuses duplicates) */
                st->frozen = 1;
                o->state2 = (int32_t)y;
                m->sp--;
                break;
            }
            if (o->tag != V_OBJ || o->frozen)
                return -1;
            if (o->kind == G_TP ? st->tag != V_TUPLE : st->tag != V_DICT)
                return -1;
            if (st->tag == V_DICT)
                st->frozen = 1;
            o->state = (int32_t)y;
            o->frozen = 1;
            m->sp--;
            break;
        }
        default:
            return -1;
        }
    }
    return -1; /* no STOP */
}

/* ---------------------------------------------------------- the index */

typedef struct {
    uint32_t fqn_off, fqn_len;
    int kind;                /* DCPX_MD_TENSOR / DCPX_MD_BYTES */
    int dtype;
    int ndim;
    uint32_t size_at;        /* into dims */
    int eligible;            /* one chunk, the whole tensor, not empty */
    Py_ssize_t whole;        /* storage entry of its whole single chunk */
    Py_ssize_t chunk_at;     /* its chunks: ch[chunk_at .. + nchunks] */
    uint32_t nchunks;
    uint32_t next_link;      /* build: the chunk its next storage entry
                              * likely belongs to (both lists in rank order) */
} mentry;

/* A tensor's saved chunk: offsets and sizes (its entry's ndim of them)
 * in dims, and its storage entry (-1: none; plan_reads names it). */
typedef struct {
    uint32_t off_at, sz_at;
    Py_ssize_t store;
} mchunk;

typedef struct {
    uint32_t fqn_off, fqn_len;
    int off_ndim;            /* -1: offset None */
    uint32_t off_at;
    Py_ssize_t file;
    int64_t offset, length;
} mstore;

struct dcpx_mdindex {
    PyObject *data;          /* the bytes the offsets point into */
    PyObject *dtypes;        /* the dtype table */
    const char *p;
    mentry *e;
    Py_ssize_t ne;
    mstore *st;
    Py_ssize_t nst;
    int64_t *dims;
    size_t ndims, cdims;
    uint32_t *files;         /* value-less: (off, len) pairs into p */
    Py_ssize_t nfiles;
    Py_ssize_t *table;       /* open addressing over e by fqn, -1 empty */
    size_t tmask;
    mchunk *ch;              /* every tensor's chunks, in their list order */
    Py_ssize_t nch, cch;
};

static uint64_t hash_bytes(const char *s, size_t n, uint64_t h)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {     /* 8 bytes at a time, then the tail */
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 31;
    }
    for (; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 0x100000001b3ULL;
    h ^= h >> 32;
    h *= 0x9e3779b97f4a7c15ULL;
    return h ^ (h >> 29);
}

static void index_free(dcpx_mdindex *ix)
{
    if (ix == NULL)
        return;
    Py_XDECREF(ix->data);
    Py_XDECREF(ix->dtypes);
    free(ix->e);
    free(ix->st);
    free(ix->dims);
    free(ix->files);
    free(ix->table);
    free(ix->ch);
    free(ix);
}

static void index_capsule_free(PyObject *cap)
{
    index_free(PyCapsule_GetPointer(cap, DCPX_MDINDEX_NAME));
}

/* Fields of an object's dict state, by name; -1 if a key is not a string,
 * not in names, or repeated.  out[k] = value or -1. */
static int fields(const vm *m, const val *o, const char *const *names, int nn,
                  int32_t *out, uint32_t *cache)
{
    for (int k = 0; k < nn; k++)
        out[k] = -1;
    /* the BUILD state, then (a Metadata in the split form) the second's */
    for (int part = 0; part < 2; part++) {
        int32_t state = part == 0 ? o->state : o->state2;
        if (state < 0)
            continue;
        const val *d = &m->v[state];
        if (d->tag != V_DICT)
            return -1;
        for (int32_t s = d->head; s >= 0; s = m->s[s].next) {
            for (uint32_t j = 0; j < m->s[s].count; j += 2) {
                uint32_t kv = m->refs[m->s[s].start + j];
                const val *key = &m->v[kv];
                int k = 0;
                while (k < nn && cache[k] != kv)
                    k++;
                if (k == nn) {
                    k = 0;
                    while (k < nn && !str_is(m, key, names[k]))
                        k++;
                    if (k < nn)
                        cache[k] = kv;
                }
                if (k == nn || out[k] >= 0)
                    return -1;
                out[k] = (int32_t)m->refs[m->s[s].start + j + 1];
            }
        }
    }
    return 0;
}

static int mi_fields(const vm *m, const val *x, int32_t *f)
{
    static const char *const names[] = {"fqn", "offset", "index"};
    if (fields(m, x, names, 3, f, (uint32_t *)m->nc_mi) < 0 || f[0] < 0 || m->v[f[0]].tag != V_STR)
        return -1;
    if (f[1] >= 0 && m->v[f[1]].tag != V_NONE && m->v[f[1]].tag != V_SIZE)
        return -1;
    if (f[2] >= 0 && m->v[f[2]].tag != V_NONE && m->v[f[2]].tag != V_INT)
        return -1;
    return 0;
}

static int mi_valid(const vm *m, const val *x)
{
    int32_t f[3];
    return mi_fields(m, x, f) == 0;
}

/* dims of a V_SIZE into ix->dims; its count in *nd. */
static int put_dims(const vm *m, dcpx_mdindex *ix, const val *sz, int *nd,
                    uint32_t *at)
{
    const val *t = &m->v[sz->state];
    if (t->count > 64 || ix->ndims + t->count > UINT32_MAX)
        return -1;
    if (ix->ndims + t->count > ix->cdims) {
        size_t nc = 2 * ix->cdims + t->count + 64;
        int64_t *g = realloc(ix->dims, nc * sizeof(int64_t));
        if (g == NULL)
            return -2;
        ix->dims = g;
        ix->cdims = nc;
    }
    *at = (uint32_t)ix->ndims;
    *nd = (int)t->count;
    for (uint32_t k = 0; k < t->count; k++)
        ix->dims[ix->ndims++] = m->v[item(m, t, k)].num;
    return 0;
}

static const int64_t *size_dims(const vm *m, const val *sz, int64_t *buf, int *nd)
{
    const val *t = &m->v[sz->state];
    if (t->count > 64)
        return NULL;
    for (uint32_t k = 0; k < t->count; k++)
        buf[k] = m->v[item(m, t, k)].num;
    *nd = (int)t->count;
    return buf;
}

static Py_ssize_t find_entry(const dcpx_mdindex *ix, const char *key, size_t len)
{
    size_t h = (size_t)hash_bytes(key, len, 0xcbf29ce484222325ULL) & ix->tmask;
    for (;;) {
        Py_ssize_t e = ix->table[h];
        if (e < 0)
            return -1;
        if (ix->e[e].fqn_len == len && memcmp(ix->p + ix->e[e].fqn_off, key, len) == 0)
            return e;
        h = (h + 1) & ix->tmask;
    }
}

/* Keep a chunk's offsets and sizes (checked by the caller) for
 * md_index_region. */
static int add_chunk(const vm *m, dcpx_mdindex *ix, const val *off, const val *sz)
{
    int nd, rc;
    if (ix->nch == ix->cch) {
        size_t nc = 2 * (size_t)ix->cch + 64;
        mchunk *g = realloc(ix->ch, nc * sizeof(mchunk));
        if (g == NULL)
            return -2;
        ix->ch = g;
        ix->cch = (Py_ssize_t)nc;
    }
    mchunk *c = &ix->ch[ix->nch];
    if ((rc = put_dims(m, ix, off, &nd, &c->off_at)) < 0 ||
        (rc = put_dims(m, ix, sz, &nd, &c->sz_at)) < 0)
        return rc;
    c->store = -1;
    ix->nch++;
    return 0;
}

/* A tensor's metadata as _metadata._validate checks it.  -1: not valid. */
static int tensor_entry(const vm *m, dcpx_mdindex *ix, const val *o, mentry *me)
{
    static const char *const tnames[] = {"properties", "size", "chunks"};
    static const char *const cnames[] = {"offsets", "sizes"};
    int32_t f[3], cf[2];
    int rc;
    if (!o->frozen || fields(m, o, tnames, 3, f, (uint32_t *)m->nc_tsm) < 0 || f[0] < 0 || f[1] < 0 || f[2] < 0)
        return -1;
    const val *pr = &m->v[f[0]], *size = &m->v[f[1]], *chunks = &m->v[f[2]];
    if (pr->tag != V_OBJ || pr->kind != G_TP || !pr->frozen || size->tag != V_SIZE ||
        chunks->tag != V_LIST)
        return -1;
    const val *ps = &m->v[pr->state];  /* (dtype, layout, requires_grad, memfmt, pinned) */
    if (ps->count != 5)
        return -1;
    const val *pd = &m->v[item(m, ps, 0)], *pl = &m->v[item(m, ps, 1)];
    if (pd->tag != V_DTYPE || (pl->tag != V_LAYOUT && pl->tag != V_OPAQUE) ||
        m->v[item(m, ps, 2)].tag != V_BOOL || m->v[item(m, ps, 3)].tag != V_MEMFMT ||
        m->v[item(m, ps, 4)].tag != V_BOOL)
        return -1;
    me->kind = DCPX_MD_TENSOR;
    me->dtype = (int)pd->num;
    if ((rc = put_dims(m, ix, size, &me->ndim, &me->size_at)) < 0)
        return rc;
    const int64_t *sz = ix->dims + me->size_at;
    int nd = me->ndim, whole = 0, nonneg = 1;
    uint64_t numel = 1;
    for (int k = 0; k < nd; k++) {
        if (sz[k] < 0)
            nonneg = 0;
        else if (__builtin_mul_overflow(numel, (uint64_t)sz[k], &numel))
            return -1;
    }
    me->chunk_at = ix->nch;
    me->nchunks = chunks->count;
    for (int32_t s = chunks->head; s >= 0; s = m->s[s].next) {
        for (uint32_t j = 0; j < m->s[s].count; j++) {
            const val *c = &m->v[m->refs[m->s[s].start + j]];
            if (c->tag != V_OBJ || c->kind != G_CSM || !c->frozen ||
                fields(m, c, cnames, 2, cf, (uint32_t *)m->nc_csm) < 0 || cf[0] < 0 || cf[1] < 0 ||
                m->v[cf[0]].tag != V_SIZE || m->v[cf[1]].tag != V_SIZE)
                return -1;
            int64_t ob[64], sb[64];
            int on, sn;
            const int64_t *off = size_dims(m, &m->v[cf[0]], ob, &on);
            const int64_t *csz = size_dims(m, &m->v[cf[1]], sb, &sn);
            if (off == NULL || csz == NULL || on != nd || sn != nd)
                return -1;
            if ((rc = add_chunk(m, ix, &m->v[cf[0]], &m->v[cf[1]])) < 0)
                return rc;
            sz = ix->dims + me->size_at;   /* dims may have moved */
            int same = 1, zero = 1;
            for (int k = 0; k < nd; k++) {
                same &= csz[k] == sz[k];
                zero &= off[k] == 0;
            }
            if (same && zero && nonneg) {
                whole++;
                continue;
            }
            for (int k = 0; k < nd; k++) {
                int64_t end;
                if (off[k] < 0 || csz[k] < 0 || __builtin_add_overflow(off[k], csz[k], &end) ||
                    end > sz[k])
                    return -1;
            }
            whole = -1000;           /* not one whole chunk */
        }
    }
    /* whole_chunks: one chunk, the whole tensor, not empty */
    me->eligible = chunks->count == 1 && whole == 1 && numel > 0;
    return 0;
}

static int same_offset(const dcpx_mdindex *ix, const mstore *a, const mstore *b)
{
    return a->off_ndim == b->off_ndim &&
           (a->off_ndim <= 0 || memcmp(ix->dims + a->off_at, ix->dims + b->off_at,
                                       sizeof(int64_t) * (size_t)a->off_ndim) == 0);
}

/* Add storage entry k to the set `seen` (size slots, a power of two, -1
 * when free); -1 if its (fqn, offset) is there already.  The hash covers
 * the offset too: the many chunks of one key (issue 21: 160,000 of them)
 * do not share one probe chain. */
static uint64_t store_hash(const dcpx_mdindex *ix, uint32_t fqn_off, uint32_t fqn_len,
                           int off_ndim, uint32_t off_at)
{
    uint64_t h = hash_bytes(ix->p + fqn_off, fqn_len, 0xcbf29ce484222325ULL);
    h ^= (uint64_t)(int64_t)off_ndim * 0x9e3779b97f4a7c15ULL;
    if (off_ndim > 0)
        h = hash_bytes((const char *)(ix->dims + off_at), sizeof(int64_t) * (size_t)off_ndim, h);
    return h;
}

static int seen_insert(const dcpx_mdindex *ix, Py_ssize_t *seen, size_t size, Py_ssize_t k)
{
    const mstore *se = &ix->st[k];
    uint64_t h = store_hash(ix, se->fqn_off, se->fqn_len, se->off_ndim, se->off_at);
    size_t b = (size_t)h & (size - 1);
    for (; seen[b] >= 0; b = (b + 1) & (size - 1)) {
        const mstore *o = &ix->st[seen[b]];
        if (o->fqn_len == se->fqn_len &&
            memcmp(ix->p + o->fqn_off, ix->p + se->fqn_off, se->fqn_len) == 0 &&
            same_offset(ix, o, se))
            return -1;
    }
    seen[b] = k;
    return 0;
}

/* Storage entry k of key entry e, when it belongs to the key's chunk
 * after the last one linked (torch and dcpx list both a key's chunks and
 * its storage entries in the order of the ranks that saved them): linked
 * without a hash lookup. */
static void link_next(dcpx_mdindex *ix, Py_ssize_t e, Py_ssize_t k)
{
    mentry *me = &ix->e[e];
    const mstore *se = &ix->st[k];
    if (me->kind != DCPX_MD_TENSOR || se->off_ndim != me->ndim || me->next_link >= me->nchunks)
        return;
    mchunk *c = &ix->ch[me->chunk_at + me->next_link];
    if (me->ndim == 0 || memcmp(ix->dims + c->off_at, ix->dims + se->off_at,
                                sizeof(int64_t) * (size_t)me->ndim) == 0) {
        c->store = k;
        me->next_link++;
    }
}

/* Each tensor's chunks linked to their storage entries: the one keyed
 * (fqn, the chunk's offsets), as plan_reads looks it up (those link_next
 * did not link, by the hash over every entry). */
static void link_chunks(dcpx_mdindex *ix, const Py_ssize_t *seen, size_t size)
{
    for (Py_ssize_t e = 0; seen != NULL && e < ix->ne; e++) {
        const mentry *me = &ix->e[e];
        if (me->kind != DCPX_MD_TENSOR)
            continue;
        for (uint32_t j = 0; j < me->nchunks; j++) {
            mchunk *c = &ix->ch[me->chunk_at + j];
            if (c->store >= 0)
                continue;
            uint64_t h = store_hash(ix, me->fqn_off, me->fqn_len, me->ndim, c->off_at);
            for (size_t b = (size_t)h & (size - 1); seen[b] >= 0; b = (b + 1) & (size - 1)) {
                const mstore *o = &ix->st[seen[b]];
                if (o->fqn_len == me->fqn_len && o->off_ndim == me->ndim &&
                    memcmp(ix->p + o->fqn_off, ix->p + me->fqn_off, me->fqn_len) == 0 &&
                    (me->ndim == 0 || memcmp(ix->dims + o->off_at, ix->dims + c->off_at,
                                             sizeof(int64_t) * (size_t)me->ndim) == 0)) {
                    c->store = seen[b];
                    break;
                }
            }
        }
    }
}

static int build(vm *m, dcpx_mdindex *ix, uint32_t top)
{
    static const char *const mnames[] = {"state_dict_metadata", "planner_data",
                                         "storage_data", "storage_meta", "version"};
    static const char *const snames[] = {"relative_path", "offset", "length",
                                         "transform_descriptors"};
    int32_t f[5];
    int rc = 0;
    const val *md = &m->v[top];
    if (md->tag != V_OBJ || md->kind != G_METADATA || !md->frozen ||
        fields(m, md, mnames, 5, f, (uint32_t *)m->nc_md) < 0 || f[0] < 0 || f[2] < 0)
        return -1;
    const val *sdm = &m->v[f[0]], *sd = &m->v[f[2]];
    if (sdm->tag != V_DICT || sd->tag != V_DICT)
        return -1;
    if (f[3] >= 0) {
        const val *sm = &m->v[f[3]];
        static const char *const smn[] = {"checkpoint_id", "save_id", "load_id", "modules"};
        int32_t sf[4];
        if (sm->tag != V_NONE &&
            (sm->tag != V_OBJ || sm->kind != G_SMETA || fields(m, sm, smn, 4, sf, (uint32_t *)m->nc_sm) < 0))
            return -1;
    }
    /* the state dict metadata, and its table by key */
    ix->ne = sdm->count / 2;
    ix->e = calloc((size_t)ix->ne + 1, sizeof(mentry));
    size_t tsize = 16;
    while (tsize < 2 * (size_t)ix->ne + 2)
        tsize *= 2;
    ix->table = malloc(tsize * sizeof(Py_ssize_t));
    if (ix->e == NULL || ix->table == NULL)
        return -2;
    memset(ix->table, 0xff, tsize * sizeof(Py_ssize_t));
    ix->tmask = tsize - 1;
    Py_ssize_t ne = 0;
    for (int32_t s = sdm->head; s >= 0; s = m->s[s].next) {
        for (uint32_t j = 0; j < m->s[s].count; j += 2, ne++) {
            const val *key = &m->v[m->refs[m->s[s].start + j]];
            const val *o = &m->v[m->refs[m->s[s].start + j + 1]];
            mentry *me = &ix->e[ne];
            if (key->tag != V_STR || o->tag != V_OBJ)
                return -1;
            me->fqn_off = (uint32_t)key->num;
            me->fqn_len = key->len;
            me->whole = -1;
            if (o->kind == G_BSM) {
                if (o->state >= 0 && m->v[o->state].count != 0)
                    return -1;
                me->kind = DCPX_MD_BYTES;
            }
            else if (o->kind != G_TSM || (rc = tensor_entry(m, ix, o, me)) < 0) {
                return o->kind != G_TSM ? -1 : rc;
            }
            size_t h = (size_t)hash_bytes(ix->p + me->fqn_off, me->fqn_len,
                                          0xcbf29ce484222325ULL) & ix->tmask;
            for (Py_ssize_t c; (c = ix->table[h]) >= 0; h = (h + 1) & ix->tmask)
                if (ix->e[c].fqn_len == me->fqn_len &&
                    memcmp(ix->p + ix->e[c].fqn_off, ix->p + me->fqn_off, me->fqn_len) == 0)
                    return -1;   /* a repeated key */
            ix->table[h] = ne;
        }
    }
    /* the storage entries: checked, their files named once */
    ix->nst = sd->count / 2;
    ix->st = calloc((size_t)ix->nst + 1, sizeof(mstore));
    size_t ssize = 16;
    while (ssize < 2 * (size_t)ix->nst + 2)
        ssize *= 2;
    Py_ssize_t *seen = NULL;     /* (fqn, offset) of keys not in the state dict */
    /* files, by name: at most one per storage entry, so the table and the
     * names (bounded by the pickle's size, as the entries are) are sized
     * once, ssize slots (a power of two, over twice the entries) */
    Py_ssize_t *ftab = malloc(ssize * sizeof(Py_ssize_t));
    ix->files = malloc(sizeof(uint32_t) * 2 * ((size_t)ix->nst + 1));
    if (ix->st == NULL || ftab == NULL || ix->files == NULL) {
        free(ftab);
        return -2;
    }
    memset(ftab, 0xff, ssize * sizeof(Py_ssize_t));
    rc = 0;
    Py_ssize_t ns = 0;
    for (int32_t s = sd->head; rc == 0 && s >= 0; s = m->s[s].next) {
        for (uint32_t j = 0; rc == 0 && j < m->s[s].count; j += 2, ns++) {
            const val *k = &m->v[m->refs[m->s[s].start + j]];
            const val *info = &m->v[m->refs[m->s[s].start + j + 1]];
            mstore *se = &ix->st[ns];
            int32_t kf[3], sf[4];
            const val *rel, *off, *len;
            if (k->tag != V_OBJ || k->kind != G_MI || mi_fields(m, k, kf) < 0 ||
                info->tag != V_OBJ || info->kind != G_SI || !info->frozen) {
                rc = -1;
                break;
            }
            if (info->reduced) {
                const val *a = &m->v[info->state];
                rel = &m->v[item(m, a, 0)];
                off = &m->v[item(m, a, 1)];
                len = &m->v[item(m, a, 2)];
            }
            else {
                if (fields(m, info, snames, 4, sf, (uint32_t *)m->nc_si) < 0 || sf[0] < 0 || sf[1] < 0 ||
                    sf[2] < 0 || (sf[3] >= 0 && m->v[sf[3]].tag != V_NONE)) {
                    rc = -1;
                    break;
                }
                rel = &m->v[sf[0]];
                off = &m->v[sf[1]];
                len = &m->v[sf[2]];
            }
            if (rel->tag != V_STR || off->tag != V_INT || len->tag != V_INT ||
                off->num < 0 || len->num < 0 || rel->len == 0) {
                rc = -1;
                break;
            }
            const char *rp = ix->p + rel->num;
            if (memchr(rp, '/', rel->len) || memchr(rp, '\\', rel->len) ||
                memchr(rp, 0, rel->len) || (rel->len == 1 && rp[0] == '.') ||
                (rel->len == 2 && rp[0] == '.' && rp[1] == '.')) {
                rc = -1;
                break;
            }
            const val *fq = &m->v[kf[0]];
            se->fqn_off = (uint32_t)fq->num;
            se->fqn_len = fq->len;
            se->off_ndim = -1;
            if (kf[1] >= 0 && m->v[kf[1]].tag == V_SIZE &&
                (rc = put_dims(m, ix, &m->v[kf[1]], &se->off_ndim, &se->off_at)) < 0)
                break;
            se->offset = off->num;
            se->length = len->num;
            /* its key's entry: the one at the same position when both
             * name the same (memoized) string, as dcpx and torch write */
            Py_ssize_t e = ns < ix->ne && ix->e[ns].fqn_off == se->fqn_off &&
                                   ix->e[ns].fqn_len == se->fqn_len
                               ? ns
                               : find_entry(ix, ix->p + se->fqn_off, se->fqn_len);
            /* a repeated (fqn, offset) key: leave it to Python (one hash
             * set over every entry: a scan of the key's earlier entries
             * was quadratic in its chunks) */
            if (seen == NULL) {
                if ((seen = malloc(ssize * sizeof(Py_ssize_t))) == NULL) {
                    rc = -2;
                    break;
                }
                memset(seen, 0xff, ssize * sizeof(Py_ssize_t));
            }
            if ((rc = seen_insert(ix, seen, ssize, ns)) < 0)
                break;
            if (e >= 0)
                link_next(ix, e, ns);
            /* whole_chunks: the entry whose offset is its chunk's (all
             * zeros; not None, even for a 0-d tensor: torch and plan_reads
             * look the chunk up by its offsets, torch.Size([]), which an
             * offset-less MetadataIndex does not equal) */
            if (e >= 0 && ix->e[e].eligible) {
                mentry *me = &ix->e[e];
                int match = se->off_ndim == me->ndim;
                for (int d = 0; match && d < se->off_ndim; d++)
                    match = ix->dims[se->off_at + d] == 0;
                if (match)
                    me->whole = ns;
            }
            /* its file */
            /* (the table holds at most ns + 1 <= nst of its ssize > 2 nst
             * slots: a probe always ends at a free one) */
            size_t fh = (size_t)hash_bytes(rp, rel->len, 0xcbf29ce484222325ULL) & (ssize - 1);
            Py_ssize_t fi = -1;
            for (Py_ssize_t c; (c = ftab[fh]) >= 0; fh = (fh + 1) & (ssize - 1)) {
                if (ix->files[2 * c + 1] == rel->len &&
                    memcmp(ix->p + ix->files[2 * c], rp, rel->len) == 0) {
                    fi = c;
                    break;
                }
            }
            if (fi < 0) {
                fi = ix->nfiles++;
                ix->files[2 * fi] = (uint32_t)rel->num;
                ix->files[2 * fi + 1] = rel->len;
                ftab[fh] = fi;
            }
            se->file = fi;
        }
    }
    if (rc == 0)
        link_chunks(ix, seen, ssize);
    free(seen);
    free(ftab);
    return rc;
}

PyObject *dcpx_md_index(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *data, *globals, *dtypes, *out = NULL;
    Py_ssize_t body;
    vm m;
    dcpx_mdindex *ix = NULL;
    int rc;

    if (!PyArg_ParseTuple(args, "SnO!O!:md_index", &data, &body, &PyDict_Type, &globals,
                          &PyList_Type, &dtypes))
        return NULL;
    if (body < 0 || body > PyBytes_GET_SIZE(data) || body > 0x7fffffff) {
        PyErr_SetString(PyExc_ValueError, "dcpx: md_index: bad body length");
        return NULL;
    }
    memset(&m, 0, sizeof(m));
    memset(m.nc_md, 0xff, sizeof(m.nc_md));
    memset(m.nc_sm, 0xff, sizeof(m.nc_sm));
    memset(m.nc_tsm, 0xff, sizeof(m.nc_tsm));
    memset(m.nc_csm, 0xff, sizeof(m.nc_csm));
    memset(m.nc_mi, 0xff, sizeof(m.nc_mi));
    memset(m.nc_si, 0xff, sizeof(m.nc_si));
    m.p = (const unsigned char *)PyBytes_AS_STRING(data);
    m.n = (size_t)body;
    m.globals = globals;
    /* every value takes at least one opcode byte, most several */
    m.cv = (uint32_t)(m.n / 6 + 64);
    m.cr = (uint32_t)(m.n / 8 + 64);
    m.cs = (uint32_t)(m.n / 16 + 64);
    m.v = malloc(sizeof(val) * m.cv);
    m.refs = malloc(sizeof(uint32_t) * m.cr);
    m.s = malloc(sizeof(seg) * m.cs);
    rc = m.v && m.refs && m.s ? run(&m) : -2;
    if (rc == 0) {
        ix = calloc(1, sizeof(*ix));
        if (ix == NULL) {
            rc = -2;
        }
        else {
            ix->p = (const char *)m.p;
            rc = build(&m, ix, m.stack[0]);
            for (Py_ssize_t e = 0; rc == 0 && e < ix->ne; e++) {
                const mentry *me = &ix->e[e];
                if (me->kind == DCPX_MD_TENSOR && me->dtype >= PyList_GET_SIZE(dtypes))
                    rc = -1;
            }
        }
    }
    free(m.v);
    free(m.s);
    free(m.refs);
    free(m.stack);
    free(m.marks);
    free(m.memo);
    if (rc == -2) {
        index_free(ix);
        return PyErr_NoMemory();
    }
    if (rc < 0) {
        index_free(ix);
        Py_RETURN_NONE;
    }
    Py_INCREF(data);
    ix->data = data;
    Py_INCREF(dtypes);
    ix->dtypes = dtypes;
    PyObject *files = PyList_New(ix->nfiles);
    for (Py_ssize_t f = 0; files != NULL && f < ix->nfiles; f++) {
        PyObject *s = PyUnicode_DecodeASCII(ix->p + ix->files[2 * f], ix->files[2 * f + 1],
                                            NULL);
        if (s == NULL)
            Py_CLEAR(files);
        else
            PyList_SET_ITEM(files, f, s);
    }
    PyObject *cap = files ? PyCapsule_New(ix, DCPX_MDINDEX_NAME, index_capsule_free) : NULL;
    if (cap == NULL) {
        Py_XDECREF(files);
        index_free(ix);
        return NULL;
    }
    out = Py_BuildValue("(NN)", cap, files);
    return out;
}

static dcpx_mdindex *get_index(PyObject *cap)
{
    return PyCapsule_GetPointer(cap, DCPX_MDINDEX_NAME);
}

PyObject *dcpx_md_index_check(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *cap, *sizes;
    if (!PyArg_ParseTuple(args, "OO!:md_index_check", &cap, &PyList_Type, &sizes))
        return NULL;
    dcpx_mdindex *ix = get_index(cap);
    if (ix == NULL)
        return NULL;
    if (PyList_GET_SIZE(sizes) != ix->nfiles) {
        PyErr_SetString(PyExc_ValueError, "dcpx: md_index_check: one size per file");
        return NULL;
    }
    int64_t *fs = malloc(sizeof(int64_t) * ((size_t)ix->nfiles + 1));
    if (fs == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t f = 0; f < ix->nfiles; f++) {
        PyObject *o = PyList_GET_ITEM(sizes, f);
        /* None: INT64_MIN, not checked; a negative size: none fits */
        fs[f] = o == Py_None ? INT64_MIN : PyLong_AsLongLong(o);
        if (fs[f] == -1 && PyErr_Occurred()) {
            free(fs);
            return NULL;
        }
        if (fs[f] == INT64_MIN && o != Py_None)
            fs[f] = -1;
    }
    int ok = 1;
    for (Py_ssize_t k = 0; ok && k < ix->nst; k++) {
        const mstore *se = &ix->st[k];
        int64_t end;
        if (fs[se->file] != INT64_MIN &&
            (__builtin_add_overflow(se->offset, se->length, &end) || end > fs[se->file]))
            ok = 0;
    }
    free(fs);
    return PyBool_FromLong(ok);
}

PyObject *dcpx_md_index_bytes(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *cap, *cls;
    if (!PyArg_ParseTuple(args, "OO:md_index_bytes", &cap, &cls))
        return NULL;
    dcpx_mdindex *ix = get_index(cap);
    if (ix == NULL)
        return NULL;
    PyObject *out = PyDict_New();
    for (Py_ssize_t k = 0; out != NULL && k < ix->nst; k++) {
        const mstore *se = &ix->st[k];
        if (se->off_ndim >= 0)
            continue;
        PyObject *key = PyUnicode_DecodeASCII(ix->p + se->fqn_off, se->fqn_len, NULL);
        PyObject *v = key ? PyObject_CallFunction(
                                cls, "s#LL", ix->p + ix->files[2 * se->file],
                                (Py_ssize_t)ix->files[2 * se->file + 1],
                                (long long)se->offset, (long long)se->length)
                          : NULL;
        if (v == NULL || PyDict_SetItem(out, key, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(v);
    }
    return out;
}

/* dims as a size_cls (torch.Size) of ints. */
static PyObject *dims_obj(const int64_t *d, int nd, PyObject *size_cls)
{
    PyObject *t = PyTuple_New(nd);
    for (int k = 0; t != NULL && k < nd; k++) {
        PyObject *v = PyLong_FromLongLong(d[k]);
        if (v == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, k, v);
    }
    PyObject *out = t ? PyObject_CallOneArg(size_cls, t) : NULL;
    Py_XDECREF(t);
    return out;
}

/* A region's bounds: (offsets, sizes) tuples of ints, one per dimension.
 * 1: not nd of them (the destination has another shape: plan_reads
 * raises its size mismatch; no chunk meets it); -1: an error set. */
static int region_bounds(PyObject *region, int nd, int64_t *lo, int64_t *hi)
{
    if (!PyTuple_Check(region) || PyTuple_GET_SIZE(region) != 2)
        goto bad;
    PyObject *o = PyTuple_GET_ITEM(region, 0), *n = PyTuple_GET_ITEM(region, 1);
    if (!PyTuple_Check(o) || !PyTuple_Check(n) || PyTuple_GET_SIZE(o) != PyTuple_GET_SIZE(n))
        goto bad;
    if (PyTuple_GET_SIZE(o) != nd)
        return 1;
    for (int k = 0; k < nd; k++) {
        int64_t a = PyLong_AsLongLong(PyTuple_GET_ITEM(o, k));
        int64_t b = PyLong_AsLongLong(PyTuple_GET_ITEM(n, k));
        if ((a == -1 || b == -1) && PyErr_Occurred())
            return -1;
        lo[k] = a;
        if (__builtin_add_overflow(a, b, &hi[k]))
            hi[k] = INT64_MAX;
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "dcpx: md_index_region: region is (offsets, sizes), "
                                      "two tuples of ints of one length");
    return -1;
}

/* md_index_region(index, fqn, region, chunk_cls, size_cls, info_cls):
 * what plan_reads needs of key fqn for one rank, without the Metadata of
 * every key.  None: no such key; (): a non-tensor value; else
 * (dtype, size, chunks, infos): of the key's saved chunks, in their order,
 * those that meet region = (offsets, sizes) in every dimension (as
 * plan_reads tests it; every chunk of a 0-d tensor; none for region None),
 * as chunk_cls(size_cls(offsets), size_cls(sizes)), and each one's storage
 * entry as info_cls(path, offset, length), None where it has none.  A scan
 * of the key's chunks in C (R of them at R ranks, nanoseconds each), not
 * ~20 Python objects per chunk of every key. */
PyObject *dcpx_md_index_region(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *cap, *fqn, *region, *chunk_cls, *size_cls, *info_cls;
    if (!PyArg_ParseTuple(args, "OUOOOO:md_index_region", &cap, &fqn, &region, &chunk_cls,
                          &size_cls, &info_cls))
        return NULL;
    dcpx_mdindex *ix = get_index(cap);
    if (ix == NULL)
        return NULL;
    Py_ssize_t len;
    const char *key = PyUnicode_AsUTF8AndSize(fqn, &len);
    if (key == NULL)
        return NULL;
    Py_ssize_t e = find_entry(ix, key, (size_t)len);
    if (e < 0)
        Py_RETURN_NONE;
    const mentry *me = &ix->e[e];
    if (me->kind == DCPX_MD_BYTES)
        return PyTuple_New(0);
    int nd = me->ndim;
    int64_t lo[64], hi[64];
    int none = region == Py_None;
    if (!none && (none = region_bounds(region, nd, lo, hi)) < 0)
        return NULL;
    PyObject *chunks = PyList_New(0), *infos = PyList_New(0);
    for (uint32_t j = 0; chunks && infos && !none && j < me->nchunks; j++) {
        const mchunk *c = &ix->ch[me->chunk_at + j];
        const int64_t *co = ix->dims + c->off_at, *cn = ix->dims + c->sz_at;
        int meets = 1;
        for (int k = 0; meets && k < nd; k++) {
            int64_t a = lo[k] > co[k] ? lo[k] : co[k];
            int64_t b = hi[k] < co[k] + cn[k] ? hi[k] : co[k] + cn[k];
            meets = a < b;
        }
        if (!meets)
            continue;
        PyObject *off = dims_obj(co, nd, size_cls);
        PyObject *sz = off ? dims_obj(cn, nd, size_cls) : NULL;
        PyObject *ch = off && sz ? PyObject_CallFunctionObjArgs(chunk_cls, off, sz, NULL) : NULL;
        PyObject *info = NULL;
        if (ch != NULL && c->store < 0) {
            Py_INCREF(Py_None);       /* Py_NewRef is 3.10+ */
            info = Py_None;
        }
        else if (ch != NULL) {
            const mstore *se = &ix->st[c->store];
            info = PyObject_CallFunction(info_cls, "s#LL", ix->p + ix->files[2 * se->file],
                                         (Py_ssize_t)ix->files[2 * se->file + 1],
                                         (long long)se->offset, (long long)se->length);
        }
        if (info == NULL || PyList_Append(chunks, ch) < 0 || PyList_Append(infos, info) < 0) {
            Py_CLEAR(chunks);
        }
        Py_XDECREF(off);
        Py_XDECREF(sz);
        Py_XDECREF(ch);
        Py_XDECREF(info);
    }
    PyObject *size = chunks && infos ? dims_obj(ix->dims + me->size_at, nd, size_cls) : NULL;
    if (size == NULL) {
        Py_XDECREF(chunks);
        Py_XDECREF(infos);
        return NULL;
    }
    PyObject *d = PyList_GET_ITEM(ix->dtypes, me->dtype);
    PyObject *dtype = PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 2 ? PyTuple_GET_ITEM(d, 0) : d;
    return Py_BuildValue("(ONNN)", dtype, size, chunks, infos);
}

/* The number of keys (state_dict_metadata entries): dcpx.load compares it
 * with the keys it asked for, to tell cheaply whether it left any out. */
PyObject *dcpx_md_index_len(PyObject *Py_UNUSED(module), PyObject *cap)
{
    dcpx_mdindex *ix = get_index(cap);
    if (ix == NULL)
        return NULL;
    return PyLong_FromSsize_t(ix->ne);
}

/* For tests: what the tables say, as Python values. */
PyObject *dcpx_md_index_entries(PyObject *Py_UNUSED(module), PyObject *cap)
{
    dcpx_mdindex *ix = get_index(cap);
    if (ix == NULL)
        return NULL;
    PyObject *ents = PyDict_New(), *stor = PyList_New(0);
    for (Py_ssize_t e = 0; ents && stor && e < ix->ne; e++) {
        const mentry *me = &ix->e[e];
        PyObject *v;
        if (me->kind == DCPX_MD_BYTES) {
            v = Py_BuildValue("(s)", "bytes");
        }
        else {
            PyObject *size = PyTuple_New(me->ndim);
            for (int d = 0; size && d < me->ndim; d++)
                PyTuple_SET_ITEM(size, d, PyLong_FromLongLong(ix->dims[me->size_at + d]));
            v = size ? Py_BuildValue("(sONn)", "tensor",
                                     PyTuple_GET_ITEM(PyList_GET_ITEM(ix->dtypes, me->dtype), 0),
                                     size, me->whole) : NULL;
        }
        PyObject *k = PyUnicode_DecodeASCII(ix->p + me->fqn_off, me->fqn_len, NULL);
        if (v == NULL || k == NULL || PyDict_SetItem(ents, k, v) < 0)
            Py_CLEAR(ents);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    for (Py_ssize_t i = 0; ents && stor && i < ix->nst; i++) {
        const mstore *se = &ix->st[i];
        PyObject *off = Py_None;
        Py_INCREF(off);
        if (se->off_ndim >= 0) {
            Py_DECREF(off);
            off = PyTuple_New(se->off_ndim);
            for (int d = 0; off && d < se->off_ndim; d++)
                PyTuple_SET_ITEM(off, d, PyLong_FromLongLong(ix->dims[se->off_at + d]));
        }
        PyObject *t = off ? Py_BuildValue("(s#Ns#LL)", ix->p + se->fqn_off,
                                          (Py_ssize_t)se->fqn_len, off,
                                          ix->p + ix->files[2 * se->file],
                                          (Py_ssize_t)ix->files[2 * se->file + 1],
                                          (long long)se->offset, (long long)se->length)
                          : NULL;
        if (t == NULL || PyList_Append(stor, t) < 0)
            Py_CLEAR(stor);
        Py_XDECREF(t);
    }
    if (ents == NULL || stor == NULL) {
        Py_XDECREF(ents);
        Py_XDECREF(stor);
        return NULL;
    }
    return Py_BuildValue("(NN)", ents, stor);
}

/* --- for reader.c's read_plan_md */

const dcpx_mdindex *dcpx_mdindex_get(PyObject *cap)
{
    return get_index(cap);
}

int dcpx_mdindex_find(const dcpx_mdindex *ix, const char *key, Py_ssize_t len,
                      Py_ssize_t *cursor, dcpx_md_tensor *out)
{
    /* the entry after the last one found, when the keys come in the
     * checkpoint's order (a load into the state dict that was saved) */
    Py_ssize_t e = *cursor;
    if (!(e < ix->ne && ix->e[e].fqn_len == (size_t)len &&
          memcmp(ix->p + ix->e[e].fqn_off, key, (size_t)len) == 0))
        e = find_entry(ix, key, (size_t)len);
    if (e < 0)
        return 0;
    *cursor = e + 1;
    const mentry *me = &ix->e[e];
    if (me->kind == DCPX_MD_BYTES)
        return DCPX_MD_BYTES;
    out->ndim = me->ndim;
    out->size = ix->dims + me->size_at;
    out->whole = me->whole >= 0;
    out->entry = me->whole;
    if (out->whole) {
        const mstore *se = &ix->st[me->whole];
        out->file = se->file;
        out->offset = (uint64_t)se->offset;
        out->length = (uint64_t)se->length;
    }
    PyObject *d = PyList_GET_ITEM(ix->dtypes, me->dtype);
    out->dtype = PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 2 ? PyTuple_GET_ITEM(d, 0) : NULL;
    PyObject *st = out->dtype ? PyTuple_GET_ITEM(d, 1) : NULL;
    out->storage_type = st && PyUnicode_Check(st) ? PyUnicode_AsUTF8(st) : NULL;
    if (out->storage_type == NULL)
        PyErr_Clear();
    return DCPX_MD_TENSOR;
}

Py_ssize_t dcpx_mdindex_nfiles(const dcpx_mdindex *ix)
{
    return ix->nfiles;
}

Py_ssize_t dcpx_mdindex_nstorage(const dcpx_mdindex *ix)
{
    return ix->nst;
}
