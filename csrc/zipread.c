/* Parse the torch.save archive of one tensor, as found in a DCP data file.
 *
 * Everything here reads bytes from a checkpoint, which may be truncated,
 * corrupted or crafted: every offset and length is checked against the
 * buffer it indexes and against the archive's length before use, and any
 * form we do not fully understand is reported as DCPX_PARSE_UNSUPPORTED so
 * that the caller can fall back to torch.load(weights_only=True) instead of
 * guessing.  fuzz/ holds a libFuzzer harness for these functions.
 */
#include "dcpx.h"

#include <string.h>

static uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p)
{
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

#define FAIL(code, msg) \
    do {                \
        *why = (msg);   \
        return (code);  \
    } while (0)

int dcpx_zip_find_cd(const unsigned char *tail, size_t tail_len,
                     uint64_t archive_len, uint64_t *cd_off, uint64_t *cd_len,
                     const char **why)
{
    size_t pos, lo;
    if (tail_len < 22 || tail_len > archive_len)
        FAIL(DCPX_PARSE_CORRUPT, "archive too short for a zip end record");
    lo = tail_len > 22 + 65535 ? tail_len - 22 - 65535 : 0;
    for (pos = tail_len - 22;; pos--) {
        if (rd32(tail + pos) == 0x06054b50 &&
            pos + 22 + rd16(tail + pos + 20) == tail_len)
            break;
        if (pos == lo)
            FAIL(DCPX_PARSE_CORRUPT, "zip end-of-central-directory not found");
    }
    uint64_t eocd_at = archive_len - tail_len + pos; /* archive offset */
    uint64_t entries = rd16(tail + pos + 10);
    uint64_t size = rd32(tail + pos + 12), off = rd32(tail + pos + 16);
    uint64_t end_of_cd = eocd_at;

    if (pos >= 20 && rd32(tail + pos - 20) == 0x07064b50) {
        uint64_t z64 = rd64(tail + pos - 20 + 8);
        uint64_t start = archive_len - tail_len;
        /* z64 comes from the file: compare without forming z64 + 56,
         * which can wrap (found by fuzz/fuzz_zipread.c). */
        if (z64 < start || z64 > eocd_at - 20 || eocd_at - 20 - z64 < 56)
            FAIL(z64 >= eocd_at ? DCPX_PARSE_CORRUPT : DCPX_PARSE_NEED_MORE,
                 "zip64 end record outside the archive tail");
        const unsigned char *z = tail + (z64 - start);
        if (rd32(z) != 0x06064b50)
            FAIL(DCPX_PARSE_CORRUPT, "bad zip64 end record signature");
        entries = rd64(z + 32);
        size = rd64(z + 40);
        off = rd64(z + 48);
        end_of_cd = z64;
    }
    if (entries == 0 || entries > 4096)
        FAIL(DCPX_PARSE_CORRUPT, "implausible zip entry count");
    if (off > end_of_cd || size > end_of_cd - off)
        FAIL(DCPX_PARSE_CORRUPT, "central directory outside the archive");
    *cd_off = off;
    *cd_len = size;
    return DCPX_PARSE_OK;
}

/* The archive's folder: torch's reader (PyTorchStreamReader) takes it from
 * the name of the central directory's first record, up to its first '/'
 * ("archive/"), looks every record up under it and refuses an archive with
 * a record in another folder (a foreign "zzz/byteorder", first or not).
 * Its length with the '/', or 0 when the first record is in no folder
 * (torch refuses that archive too). */
static size_t archive_folder(const unsigned char *cd, size_t cd_len,
                             const char **folder)
{
    if (cd_len < 46 || rd32(cd) != 0x02014b50)
        return 0;
    size_t nlen = rd16(cd + 28);
    if (46 + nlen > cd_len)
        return 0;
    *folder = (const char *)cd + 46;
    const char *slash = memchr(*folder, '/', nlen);
    return slash ? (size_t)(slash - *folder) + 1 : 0;
}

/* Whether `name` (`nlen` bytes) is `rest` inside the folder `folder`. */
static int in_folder(const char *name, size_t nlen, const char *folder,
                     size_t flen, const char *rest)
{
    size_t m = strlen(rest);
    return nlen == flen + m && memcmp(name, folder, flen) == 0 &&
           memcmp(name + flen, rest, m) == 0;
}

int dcpx_zip_scan_cd(const unsigned char *cd, size_t cd_len,
                     uint64_t archive_len, uint64_t *pkl_lho,
                     uint64_t *pkl_len, uint32_t *pkl_crc, uint64_t *data_lho,
                     uint64_t *data_len, uint32_t *data_crc, const char **why)
{
    size_t pos = 0;
    const char *folder = NULL;
    size_t flen = archive_folder(cd, cd_len, &folder);
    int have_pkl = 0, have_data = 0, n_storages = 0;

    if (flen == 0)
        FAIL(DCPX_PARSE_CORRUPT, "the archive's first record is not in a folder "
                                 "(torch.load refuses it)");

    while (pos + 46 <= cd_len && rd32(cd + pos) == 0x02014b50) {
        const unsigned char *e = cd + pos;
        uint16_t method = rd16(e + 10);
        uint32_t crc = rd32(e + 16);
        uint64_t csize = rd32(e + 20), usize = rd32(e + 24);
        size_t nlen = rd16(e + 28), xlen = rd16(e + 30), clen = rd16(e + 32);
        uint64_t lho = rd32(e + 42);
        const char *name = (const char *)e + 46;

        if (pos + 46 + nlen + xlen + clen > cd_len)
            FAIL(DCPX_PARSE_CORRUPT, "central directory entry overruns");
        /* zip64 extra: present fields follow in this order (APPNOTE 4.5.3) */
        const unsigned char *x = e + 46 + nlen, *xe = x + xlen;
        while (x + 4 <= xe) {
            uint16_t id = rd16(x), sz = rd16(x + 2);
            const unsigned char *f = x + 4, *fe = f + sz;
            if (fe > xe)
                FAIL(DCPX_PARSE_CORRUPT, "zip extra field overruns");
            if (id == 0x0001) {
                if (usize == 0xFFFFFFFFu && f + 8 <= fe) { usize = rd64(f); f += 8; }
                if (csize == 0xFFFFFFFFu && f + 8 <= fe) { csize = rd64(f); f += 8; }
                if (lho == 0xFFFFFFFFu && f + 8 <= fe) { lho = rd64(f); f += 8; }
            }
            x = fe;
        }
        if (method != 0 || csize != usize)
            FAIL(DCPX_PARSE_UNSUPPORTED, "compressed zip record");
        if (lho >= archive_len || usize > archive_len)
            FAIL(DCPX_PARSE_CORRUPT, "zip record outside the archive");
        if (nlen < flen || memcmp(name, folder, flen) != 0)
            FAIL(DCPX_PARSE_CORRUPT, "a record is outside the folder of the archive's "
                                     "first record (torch.load refuses it)");
        if (in_folder(name, nlen, folder, flen, "data.pkl")) {
            if (have_pkl)
                FAIL(DCPX_PARSE_UNSUPPORTED, "two data.pkl records");
            have_pkl = 1;
            *pkl_lho = lho;
            *pkl_len = usize;
            *pkl_crc = crc;
        }
        else if (nlen > flen + 5 && memcmp(name + flen, "data/", 5) == 0) {
            n_storages++;
            if (in_folder(name, nlen, folder, flen, "data/0")) {
                have_data = 1;
                *data_lho = lho;
                *data_len = usize;
                *data_crc = crc;
            }
        }
        pos += 46 + nlen + xlen + clen;
    }
    if (!have_pkl)
        FAIL(DCPX_PARSE_CORRUPT, "archive has no data.pkl record in the folder of its "
                                 "first record (torch.load refuses it)");
    if (!have_data || n_storages != 1)
        FAIL(DCPX_PARSE_UNSUPPORTED, "archive does not hold exactly one storage");
    return DCPX_PARSE_OK;
}

/* The byteorder record of a torch.save archive (its central directory is
 * `cd`, already walked by dcpx_zip_scan_cd): torch writes "little" or
 * "big" there (serialization.py, _save), and byte-swaps every storage on
 * load when it differs from the host's order; only the record in the
 * archive's folder counts (archive_folder).  1 with its local header
 * offset and length, 0 when the archive has none (torch then assumes
 * little), -1 when its offset needs zip64 (left to torch). */
int dcpx_zip_find_byteorder(const unsigned char *cd, size_t cd_len,
                            uint64_t *lho, uint64_t *len)
{
    size_t pos = 0;
    const char *folder = NULL;
    size_t flen = archive_folder(cd, cd_len, &folder);
    if (flen == 0)
        return -1;
    while (pos + 46 <= cd_len && rd32(cd + pos) == 0x02014b50) {
        const unsigned char *e = cd + pos;
        size_t nlen = rd16(e + 28), xlen = rd16(e + 30), clen = rd16(e + 32);
        const char *name = (const char *)e + 46;
        if (pos + 46 + nlen + xlen + clen > cd_len)
            return -1;
        /* only the archive's own: torch reads "<folder>/byteorder" */
        if (in_folder(name, nlen, folder, flen, "byteorder")) {
            *lho = rd32(e + 42);
            *len = rd32(e + 24);
            return *lho == 0xFFFFFFFFu || *len == 0xFFFFFFFFu ? -1 : 1;
        }
        pos += 46 + nlen + xlen + clen;
    }
    return 0;
}

int dcpx_zip_local_data_off(const unsigned char *lh, size_t avail,
                            uint64_t *data_off, const char **why)
{
    if (avail < 30 || rd32(lh) != 0x04034b50)
        FAIL(DCPX_PARSE_CORRUPT, "bad zip local header");
    *data_off = 30 + (uint64_t)rd16(lh + 26) + rd16(lh + 28);
    return DCPX_PARSE_OK;
}

/* ---- the pickle of one tensor ----------------------------------------
 * A tiny stack machine for exactly the opcodes torch.save's protocol-2
 * pickle of a plain tensor uses.  It never imports or calls anything: it
 * recognises the two globals it expects and rejects all others. */

enum { V_INT, V_STR, V_TUPLE, V_GLOBAL, V_MARK, V_PERSID, V_BOOL, V_ODICT,
       V_TENSOR };

typedef struct {
    int kind;
    int64_t i;          /* V_INT, V_BOOL */
    const char *s;      /* V_STR, V_GLOBAL ("module\nname") */
    uint32_t slen;
    int first, count;   /* V_TUPLE, V_PERSID: range in the item pool */
} pv;

#define STACK_MAX 64
#define POOL_MAX 256
#define MEMO_MAX 64

typedef struct {
    pv stack[STACK_MAX];
    int sp;
    pv pool[POOL_MAX];
    int np;
    pv memo[MEMO_MAX];
    int have_memo[MEMO_MAX];
} pm;

static int str_is(const pv *v, const char *s)
{
    return (v->kind == V_STR || v->kind == V_GLOBAL) &&
           v->slen == strlen(s) && memcmp(v->s, s, v->slen) == 0;
}

static int push(pm *m, pv v)
{
    if (m->sp >= STACK_MAX)
        return -1;
    m->stack[m->sp++] = v;
    return 0;
}

/* Pop items above the top MARK (or the top n) into a tuple. */
static int make_tuple(pm *m, int n, pv *out)
{
    if (n < 0) {
        int start;
        for (start = m->sp - 1; start >= 0 && m->stack[start].kind != V_MARK;
             start--)
            ;
        if (start < 0)
            return -1;
        n = m->sp - start - 1;
    }
    else if (m->sp < n) {
        return -1;
    }
    if (m->np + n > POOL_MAX)
        return -1;
    out->kind = V_TUPLE;
    out->first = m->np;
    out->count = n;
    for (int i = 0; i < n; i++) {
        if (m->stack[m->sp - n + i].kind == V_MARK)
            return -1;
        m->pool[m->np++] = m->stack[m->sp - n + i];
    }
    m->sp -= n; /* for TUPLE the caller then pops the MARK */
    return 0;
}

static int tuple_ints(const pm *m, const pv *t, int64_t *dst, int max)
{
    if (t->kind != V_TUPLE || t->count > max)
        return -1;
    for (int i = 0; i < t->count; i++) {
        if (m->pool[t->first + i].kind != V_INT)
            return -1;
        dst[i] = m->pool[t->first + i].i;
    }
    return t->count;
}

static int do_reduce(pm *m, dcpx_tensor_record *rec, const char **why)
{
    if (m->sp < 2)
        return -1;
    pv args = m->stack[--m->sp], fn = m->stack[--m->sp];
    pv res = {0};
    if (args.kind != V_TUPLE || fn.kind != V_GLOBAL)
        return -1;
    if (str_is(&fn, "collections\nOrderedDict") && args.count == 0) {
        res.kind = V_ODICT;
        return push(m, res);
    }
    int v3 = str_is(&fn, "torch._utils\n_rebuild_tensor_v3");
    if (!(v3 ? args.count == 7
             : str_is(&fn, "torch._utils\n_rebuild_tensor_v2") &&
                   args.count == 6)) {
        *why = "pickle calls something other than _rebuild_tensor_v2/v3";
        return -1;
    }
    const pv *a = &m->pool[args.first];
    if (a[0].kind != V_PERSID || a[1].kind != V_INT || a[4].kind != V_BOOL ||
        a[5].kind != V_ODICT)
        return -1;
    /* persistent id: ('storage', <storage type>, key, location, numel) */
    const pv *p = &m->pool[a[0].first];
    if (a[0].count != 5 || !str_is(&p[0], "storage") ||
        p[1].kind != V_GLOBAL || !str_is(&p[2], "0") || p[4].kind != V_INT ||
        p[4].i < 0)
        return -1;
    /* The dtype: the typed storage's class name (v2), or the dtype global
     * passed as the 7th argument next to an UntypedStorage (v3). */
    const pv *name = v3 ? &a[6] : &p[1];
    if (v3 && !str_is(&p[1], "torch.storage\nUntypedStorage"))
        return -1;
    if (name->kind != V_GLOBAL || name->slen < 7 ||
        memcmp(name->s, "torch\n", 6) != 0 ||
        name->slen - 6 >= sizeof(rec->storage_type))
        return -1;
    memcpy(rec->storage_type, name->s + 6, name->slen - 6);
    rec->storage_type[name->slen - 6] = 0;
    rec->storage_numel = (uint64_t)p[4].i;
    rec->numel_in_bytes = v3;
    if (a[1].i < 0)
        return -1;
    rec->storage_offset = (uint64_t)a[1].i;
    int nd = tuple_ints(m, &a[2], rec->shape, 16);
    if (nd < 0 || tuple_ints(m, &a[3], rec->stride, 16) != nd)
        return -1;
    rec->ndim = nd;
    res.kind = V_TENSOR;
    return push(m, res);
}

int dcpx_pickle_parse_tensor(const unsigned char *p, size_t n,
                             dcpx_tensor_record *rec, const char **why)
{
    static pm zero;
    pm m_ = zero, *m = &m_;
    size_t i = 0;
    pv v;

    *why = "unrecognised tensor pickle";
#define NEED(k)                                          \
    do {                                                 \
        if (i + (k) > n)                                 \
            FAIL(DCPX_PARSE_CORRUPT, "truncated pickle"); \
    } while (0)
    while (i < n) {
        unsigned char op = p[i++];
        memset(&v, 0, sizeof(v));
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1);
            i++;
            break;
        case 'c': {                      /* GLOBAL module\nname\n */
            const unsigned char *nl1 = memchr(p + i, '\n', n - i);
            if (!nl1) FAIL(DCPX_PARSE_CORRUPT, "truncated pickle");
            const unsigned char *nl2 =
                memchr(nl1 + 1, '\n', n - (size_t)(nl1 + 1 - p));
            if (!nl2) FAIL(DCPX_PARSE_CORRUPT, "truncated pickle");
            v.kind = V_GLOBAL;
            v.s = (const char *)p + i;
            v.slen = (uint32_t)(nl2 - (p + i));
            i = (size_t)(nl2 + 1 - p);
            if (push(m, v)) goto unsup;
            break;
        }
        case 'q': NEED(1); /* BINPUT */
            if (m->sp < 1 || p[i] >= MEMO_MAX) goto unsup;
            m->memo[p[i]] = m->stack[m->sp - 1];
            m->have_memo[p[i]] = 1;
            i++;
            break;
        case 'h': NEED(1); /* BINGET */
            if (p[i] >= MEMO_MAX || !m->have_memo[p[i]]) goto unsup;
            if (push(m, m->memo[p[i]])) goto unsup;
            i++;
            break;
        case '(': v.kind = V_MARK; if (push(m, v)) goto unsup; break;
        case 'X': { NEED(4); /* BINUNICODE */
            uint32_t len = rd32(p + i);
            i += 4;
            NEED(len);
            v.kind = V_STR; v.s = (const char *)p + i; v.slen = len;
            i += len;
            if (push(m, v)) goto unsup;
            break;
        }
        case 'K': /* BININT1 */
            NEED(1);
            v.kind = V_INT;
            v.i = p[i];
            i += 1;
            if (push(m, v))
                goto unsup;
            break;
        case 'M': /* BININT2 */
            NEED(2);
            v.kind = V_INT;
            v.i = rd16(p + i);
            i += 2;
            if (push(m, v))
                goto unsup;
            break;
        case 'J': /* BININT */
            NEED(4);
            v.kind = V_INT;
            v.i = (int32_t)rd32(p + i);
            i += 4;
            if (push(m, v))
                goto unsup;
            break;
        case 0x8a: { /* LONG1 */
            NEED(1);
            unsigned k = p[i++];
            NEED(k);
            if (k > 8)
                goto unsup;
            uint64_t x = 0;
            for (unsigned j = 0; j < k; j++)
                x |= (uint64_t)p[i + j] << (8 * j);
            if (k && k < 8 && (p[i + k - 1] & 0x80))
                x |= ~0ull << (8 * k); /* sign-extend */
            v.kind = V_INT;
            v.i = (int64_t)x;
            i += k;
            if (push(m, v))
                goto unsup;
            break;
        }
        case 0x88: /* NEWTRUE */
        case 0x89: /* NEWFALSE */
            v.kind = V_BOOL;
            v.i = op == 0x88;
            if (push(m, v))
                goto unsup;
            break;
        case ')': /* EMPTY_TUPLE */
            v.kind = V_TUPLE;
            v.first = m->np;
            if (push(m, v))
                goto unsup;
            break;
        case 0x85: case 0x86: case 0x87:
            if (make_tuple(m, op - 0x84, &v) || push(m, v)) goto unsup;
            break;
        case 't':
            if (make_tuple(m, -1, &v)) goto unsup;
            m->sp--; /* the MARK */
            if (push(m, v)) goto unsup;
            break;
        case 'Q': /* BINPERSID */
            if (m->sp < 1 || m->stack[m->sp - 1].kind != V_TUPLE) goto unsup;
            m->stack[m->sp - 1].kind = V_PERSID;
            break;
        case 'R':
            if (do_reduce(m, rec, why)) goto unsup;
            break;
        case '.':
            if (m->sp != 1 || m->stack[0].kind != V_TENSOR) goto unsup;
            return DCPX_PARSE_OK;
        default:
            goto unsup;
        }
    }
    FAIL(DCPX_PARSE_CORRUPT, "pickle has no STOP");
unsup:
    return DCPX_PARSE_UNSUPPORTED;
#undef NEED
}
