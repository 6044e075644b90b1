/* Build the bytes of a torch.save archive around one tensor.
 *
 * torch.load reads a zip of stored (uncompressed) records under a common
 * prefix ("archive/" for archives written to a stream, which is how DCP's
 * FileSystemWriter calls torch.save).  We emit the same records in the same
 * order as torch 2.x:
 *
 *   data.pkl, .format_version, .storage_alignment, byteorder,   <- head
 *   data/0 (the tensor's bytes, 64-byte aligned)                  <- data
 *   version, .data/serialization_id, central directory,
 *   zip64 end record + locator, end record                        <- tail
 *
 * Only the tensor bytes are large; head and tail are built here once per
 * tensor and written around the data by the writer.  data/0's CRC is known
 * only after the data is read, so its two places (local header in head,
 * central-directory entry in tail) are patched by dcpx_archive_patch_crc().
 * The zip64 extra field is used where a size or offset does not fit in 32
 * bits (APPNOTE.TXT 4.5.3); like torch we always write the zip64 end record.
 */
#include "dcpx.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PREFIX "archive/"
#define NREC 7
#define U32_MAX_FIELD 0xFFFFFFFFu

/* A fixed piece of the caller's memory: nothing here allocates (the writer
 * threads build archives in their own arenas).  With p == NULL, only the
 * length is counted (dcpx_archive_build's measuring mode). */
typedef struct {
    char *p;
    size_t len, cap;
    int full;              /* a put did not fit: the result is unusable */
} buf_t;

/* Inlined everywhere: with a constant n (every field) each put is a store. */
#define FIELD static inline __attribute__((always_inline)) void

FIELD put(buf_t *b, const void *src, size_t n)
{
    if (b->p == NULL) {
        b->len += n;
        return;
    }
    if (b->full || n > b->cap - b->len) {
        b->full = 1;
        return;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

FIELD put8(buf_t *b, uint8_t v) { put(b, &v, 1); }
FIELD put16(buf_t *b, uint16_t v)
{
    unsigned char s[2] = {(unsigned char)v, (unsigned char)(v >> 8)};
    put(b, s, 2);
}
FIELD put32(buf_t *b, uint32_t v)
{
    unsigned char s[4];
    for (int i = 0; i < 4; i++)
        s[i] = (unsigned char)(v >> (8 * i));
    put(b, s, 4);
}
FIELD put64(buf_t *b, uint64_t v)
{
    unsigned char s[8];
    for (int i = 0; i < 8; i++)
        s[i] = (unsigned char)(v >> (8 * i));
    put(b, s, 8);
}
FIELD puts_(buf_t *b, const char *s) { put(b, s, strlen(s)); }

/* ---- pickle (protocol 2) of torch._utils._rebuild_tensor_v2(...) ---- */

static void pk_int(buf_t *b, uint64_t v)
{
    if (v < 256) {
        put8(b, 'K');
        put8(b, (uint8_t)v);
    }
    else if (v < 65536) {
        put8(b, 'M');
        put16(b, (uint16_t)v);
    }
    else if (v < 0x80000000ull) {
        put8(b, 'J');
        put32(b, (uint32_t)v);
    }
    else { /* LONG1: little-endian two's complement, sign bit clear */
        unsigned char s[9];
        int n = 0;
        uint64_t x = v;
        while (x) {
            s[n++] = (unsigned char)x;
            x >>= 8;
        }
        if (s[n - 1] & 0x80)
            s[n++] = 0;
        put8(b, 0x8a);
        put8(b, (uint8_t)n);
        put(b, s, (size_t)n);
    }
}

static void pk_str(buf_t *b, const char *s)
{
    put8(b, 'X');
    put32(b, (uint32_t)strlen(s));
    puts_(b, s);
}

static void pk_tuple(buf_t *b, const int64_t *v, int n)
{
    if (n == 0) {
        put8(b, ')');
        return;
    }
    if (n > 3)
        put8(b, '(');
    for (int i = 0; i < n; i++)
        pk_int(b, (uint64_t)v[i]);
    if (n <= 3)
        put8(b, (uint8_t)(0x84 + n)); /* TUPLE1..TUPLE3 */
    else
        put8(b, 't');
}

/* Two forms, as torch.save writes them (torch/_tensor.py, _reduce_ex_internal):
 *  legacy dtypes: _rebuild_tensor_v2(('storage', torch.FloatStorage, '0',
 *                 'cpu', numel), offset, size, stride, requires_grad, hooks)
 *  newer dtypes:  _rebuild_tensor_v3(('storage', torch.storage.UntypedStorage,
 *                 '0', 'cpu', nbytes), offset, size, stride, requires_grad,
 *                 hooks, torch.<dtype>)
 * `storage_type` names the first form when it ends in "Storage", else it is
 * the dtype's name and selects the second. */
static int is_legacy(const char *storage_type)
{
    size_t n = strlen(storage_type);
    return n > 7 && strcmp(storage_type + n - 7, "Storage") == 0;
}

static void build_pickle(buf_t *b, const char *storage_type,
                         const int64_t *shape, int ndim, uint64_t numel,
                         uint64_t nbytes)
{
    int64_t stride[64];
    int64_t s = 1;
    int legacy = is_legacy(storage_type);
    /* torch's contiguous strides: the product of the later dims, each at
     * least 1.  Never multiply in dim 0: for an empty tensor like
     * (2**40, 0, 2**40) that product would overflow, and no stride uses it. */
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        if (i > 0)
            s *= shape[i] > 1 ? shape[i] : 1;
    }
    put(b, "\x80\x02", 2);
    puts_(b, legacy ? "ctorch._utils\n_rebuild_tensor_v2\n"
                    : "ctorch._utils\n_rebuild_tensor_v3\n");
    put8(b, '(');
    put8(b, '(');
    pk_str(b, "storage");
    if (legacy) {
        puts_(b, "ctorch\n");
        puts_(b, storage_type);
        put8(b, '\n');
    }
    else {
        puts_(b, "ctorch.storage\nUntypedStorage\n");
    }
    pk_str(b, "0");
    pk_str(b, "cpu");
    pk_int(b, legacy ? numel : nbytes);
    put8(b, 't');
    put8(b, 'Q'); /* BINPERSID */
    pk_int(b, 0); /* storage_offset */
    pk_tuple(b, shape, ndim);
    pk_tuple(b, stride, ndim);
    put8(b, 0x89); /* requires_grad=False: DCP saves detached tensors */
    puts_(b, "ccollections\nOrderedDict\n");
    put8(b, ')');
    put8(b, 'R');
    if (!legacy) {
        puts_(b, "ctorch\n");
        puts_(b, storage_type);
        put8(b, '\n');
    }
    put8(b, 't');
    put8(b, 'R');
    put8(b, '.');
}

/* ---- zip records ---- */

typedef struct {
    const char *name;
    size_t name_len;
    uint64_t lho;   /* local header offset, from the archive start */
    uint64_t size;
    uint32_t crc;
} rec_t;

/* Local header + padding so that the record's data starts at a multiple of
 * DCPX_ALIGN from the archive start.  `pos` is where the header starts. */
static void local_header(buf_t *b, uint64_t pos, rec_t *r, int zip64,
                         size_t *crc_at)
{
    size_t nlen = strlen(PREFIX) + r->name_len;
    size_t fixed = 30 + nlen + 4 + (zip64 ? 20 : 0);
    size_t pad = (DCPX_ALIGN - (pos + fixed) % DCPX_ALIGN) % DCPX_ALIGN;

    r->lho = pos;
    put32(b, 0x04034b50);
    put16(b, zip64 ? 45 : 20);
    put16(b, 0);   /* flags */
    put16(b, 0);   /* stored */
    put16(b, 0);   /* time */
    put16(b, 0x21); /* date: 1980-01-01 */
    if (crc_at)
        *crc_at = b->len;
    put32(b, r->crc);
    put32(b, zip64 ? U32_MAX_FIELD : (uint32_t)r->size);
    put32(b, zip64 ? U32_MAX_FIELD : (uint32_t)r->size);
    put16(b, (uint16_t)nlen);
    put16(b, (uint16_t)(4 + pad + (zip64 ? 20 : 0)));
    puts_(b, PREFIX);
    put(b, r->name, r->name_len);
    if (zip64) {
        put16(b, 0x0001);
        put16(b, 16);
        put64(b, r->size);
        put64(b, r->size);
    }
    put16(b, 0x4246); /* "FB": torch's padding field id */
    put16(b, (uint16_t)pad);
    for (size_t i = 0; i < pad; i++)
        put8(b, 'Z');
}

static void store32(char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (char)(v >> (8 * i));
}

/* A stored record of `size` bytes at `data`, its CRC computed here. */
static void small_record(buf_t *b, uint64_t base, rec_t *r, const void *data)
{
    r->crc = b->p != NULL ? dcpx_crc32(0, data, r->size) : 0;
    local_header(b, base + b->len, r, 0, NULL);
    put(b, data, r->size);
}

static void central_entry(buf_t *b, const rec_t *r, size_t *crc_at)
{
    size_t nlen = strlen(PREFIX) + r->name_len;
    int big_size = r->size >= U32_MAX_FIELD;
    int big_off = r->lho >= U32_MAX_FIELD;
    uint16_t xlen = (uint16_t)((big_size ? 16 : 0) + (big_off ? 8 : 0));

    put32(b, 0x02014b50);
    put16(b, 45 | (3 << 8)); /* made by: unix, 4.5 */
    put16(b, xlen ? 45 : 20);
    put16(b, 0);
    put16(b, 0);
    put16(b, 0);
    put16(b, 0x21);
    if (crc_at)
        *crc_at = b->len;
    put32(b, r->crc);
    put32(b, big_size ? U32_MAX_FIELD : (uint32_t)r->size);
    put32(b, big_size ? U32_MAX_FIELD : (uint32_t)r->size);
    put16(b, (uint16_t)nlen);
    put16(b, xlen ? (uint16_t)(4 + xlen) : 0);
    put16(b, 0); /* comment */
    put16(b, 0); /* disk */
    put16(b, 0); /* internal attributes */
    put32(b, 0644u << 16); /* external attributes: -rw-r--r-- */
    put32(b, big_off ? U32_MAX_FIELD : (uint32_t)r->lho);
    puts_(b, PREFIX);
    put(b, r->name, r->name_len);
    if (xlen) {
        put16(b, 0x0001);
        put16(b, xlen);
        if (big_size) {
            put64(b, r->size);
            put64(b, r->size);
        }
        if (big_off)
            put64(b, r->lho);
    }
}

static void end_records(buf_t *b, uint64_t cd_off, uint64_t cd_len,
                        uint64_t z64_off)
{
    put32(b, 0x06064b50); /* zip64 end of central directory record */
    put64(b, 44);
    put16(b, 45);
    put16(b, 45);
    put32(b, 0);
    put32(b, 0);
    put64(b, NREC);
    put64(b, NREC);
    put64(b, cd_len);
    put64(b, cd_off);
    put32(b, 0x07064b50); /* zip64 locator */
    put32(b, 0);
    put64(b, z64_off);
    put32(b, 1);
    put32(b, 0x06054b50); /* end of central directory */
    put16(b, 0);
    put16(b, 0);
    put16(b, NREC);
    put16(b, NREC);
    put32(b, cd_len >= U32_MAX_FIELD ? U32_MAX_FIELD : (uint32_t)cd_len);
    put32(b, cd_off >= U32_MAX_FIELD ? U32_MAX_FIELD : (uint32_t)cd_off);
    put16(b, 0);
}

int dcpx_archive_build(dcpx_archive *a, char *mem, size_t cap, size_t tail_skip,
                       const char *storage_type, const int64_t *shape, int ndim,
                       uint64_t numel, uint64_t nbytes, uint64_t serial)
{
    buf_t head = {mem, 0, cap, 0}, tail;
    char sid[48];
    size_t crc_at, size_at, pk_start;
#define REC(name, size) {name, sizeof(name) - 1, 0, size, 0}
    rec_t r[NREC] = {
        REC("data.pkl", 0),          REC(".format_version", 1),
        REC(".storage_alignment", 2), REC("byteorder", 6),
        REC("data/0", nbytes),        REC("version", 2),
        REC(".data/serialization_id", 40),
    };
#undef REC

    memset(a, 0, sizeof(*a));
    if (mem != NULL)
        snprintf(sid, sizeof(sid), "%040llu", (unsigned long long)serial);
    else /* measuring: only its length counts */
        memcpy(sid, "0000000000000000000000000000000000000000", 41);
    /* data.pkl: its header first (the padding depends only on where it
     * starts), then the pickle built in place; CRC and sizes patched. */
    local_header(&head, 0, &r[0], 0, &crc_at);
    size_at = crc_at + 4;
    pk_start = head.len;
    build_pickle(&head, storage_type, shape, ndim, numel, nbytes);
    if (head.full)
        goto full;
    r[0].size = head.len - pk_start;
    if (mem != NULL) {
        r[0].crc = dcpx_crc32(0, head.p + pk_start, (size_t)r[0].size);
        store32(head.p + crc_at, r[0].crc);
        store32(head.p + size_at, (uint32_t)r[0].size);
        store32(head.p + size_at + 4, (uint32_t)r[0].size);
    }
    small_record(&head, 0, &r[1], "1");
    small_record(&head, 0, &r[2], "64");
    small_record(&head, 0, &r[3], "little");
    r[4].crc = 0; /* patched by dcpx_archive_patch_crc */
    local_header(&head, head.len, &r[4], nbytes >= U32_MAX_FIELD,
                 &a->crc_pos_head);
    if (head.full)
        goto full;

    uint64_t base = head.len + nbytes; /* tail starts here */
    if (mem != NULL && tail_skip > cap - head.len)
        goto full;
    tail = (buf_t){mem ? mem + head.len + tail_skip : NULL, 0,
                   mem ? cap - head.len - tail_skip : 0, 0};
    small_record(&tail, base, &r[5], "3\n");
    small_record(&tail, base, &r[6], sid);
    uint64_t cd_off = base + tail.len;
    size_t cd_start = tail.len;
    for (int i = 0; i < NREC; i++)
        central_entry(&tail, &r[i], i == 4 ? &a->crc_pos_tail : NULL);
    uint64_t cd_len = tail.len - cd_start;
    end_records(&tail, cd_off, cd_len, base + tail.len);
    if (tail.full)
        goto full;
    a->head = head.p;
    a->head_len = head.len;
    a->tail = tail.p;
    a->tail_len = tail.len;
    return 0;
full:
    errno = ERANGE;
    return -1;
}

void dcpx_archive_patch_crc(dcpx_archive *a, uint32_t crc)
{
    store32(a->head + a->crc_pos_head, crc);
    store32(a->tail + a->crc_pos_tail, crc);
}
