/* read_items: read tensor archives straight into destination tensors.
 *
 *   failures = read_items(paths, items, threads=1, verify=True)
 *       paths: [path, ...]
 *       item:  (file_index, offset, length, dest_tensor, storage_type)
 *       storage_type "": the extent holds the tensor's bytes themselves
 *       (safetensors), read as they are (length must be its byte count)
 *   -> [(item_index, code, errno, message), ...] for items not read:
 *       code 1 FALLBACK  valid archive in a form we do not read ourselves
 *                        (caller uses torch.load(weights_only=True))
 *            2 CORRUPT   malformed archive, or one that contradicts the
 *                        metadata
 *            3 IO        a read failed (errno), or the file is short
 *            4 CRC       the tensor bytes do not match the recorded CRC-32
 *
 * Items are read in runs: the archives of one file sorted by offset, small
 * ones (<= WHOLE_MAX) that lie next to each other (gaps <= RUN_GAP) grouped
 * into one pread of at most RUN_MAX bytes into the worker's buffer, each
 * archive then parsed from it and its tensor bytes copied to the
 * destination and CRC'd in one pass (dcpx_crc32_copy).  A larger archive is
 * a run of its own: a head window and a tail window, then the tensor bytes
 * are pread directly into the destination's memory and CRC'd chunk by chunk
 * while cache-hot.  Worker threads take runs from a shared counter and touch
 * only the plain structs below; the destinations were taken through DLPack
 * beforehand.
 *
 *   plan = read_plan(paths, items, values, exporter, types)
 *       item: (file_index, offset, length, storage_type, position); the
 *       destinations values[position] (checked as below) fix what every
 *       later one must look like (dtype, shape); None if one cannot be
 *       read into in place
 *   failures = read_plan_run(plan, values, exporter, types, threads, verify)
 *       values: a sequence whose [position] is each item's destination;
 *       each must be of one of `types`, have no neg / conj bit, and export
 *       (exporter(value) -> DLPack capsule) as the plan's dtype and shape.
 *       -> None, with nothing read, when one does not (the caller plans
 *       again); else failures as read_items.
 * The plan keeps the parsed paths and items and their runs, so that a load
 * of the same checkpoint into the same layout redoes none of that work.
 */
#include "dcpx.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WHOLE_MAX ((uint64_t)256 << 10) /* read small archives in one go */
#define WINDOW DCPX_READ_WINDOW         /* head/tail windows otherwise */
#define CHUNK ((size_t)4 << 20)
#define RUN_MAX ((uint64_t)1 << 20)      /* bytes of one grouped pread */
#define RUN_GAP ((uint64_t)4 << 10)      /* largest gap read through in a run */

enum { RD_OK = DCPX_RD_OK, RD_FALLBACK = DCPX_RD_FALLBACK,
       RD_CORRUPT = DCPX_RD_CORRUPT, RD_IO = DCPX_RD_IO, RD_CRC = DCPX_RD_CRC,
       RD_SERIAL = 5 /* inside execute() only: read after the workers */ };

typedef dcpx_ritem ritem;

typedef struct {
    ritem *items;
    Py_ssize_t n;
    Py_ssize_t *order;               /* item indices sorted by (file, offset) */
    Py_ssize_t *runs;                /* run r: order[runs[r] .. runs[r + 1]) */
    Py_ssize_t nruns;
    int *fds;
    const char **fwhy;               /* per file: why it is not readable */
    char **paths;
    Py_ssize_t nfiles;
    int verify;
    atomic_long next;
    Py_ssize_t *serial;              /* execute(): items whose destinations overlap */
    Py_ssize_t nserial;
} rjob;

typedef struct {
    unsigned char *buf;              /* WHOLE_MAX or 2 windows */
    unsigned char *run;              /* RUN_MAX, allocated at first use */
} scratch;

int dcpx_pread_all(int fd, void *p, size_t n, uint64_t off)
{
    char *c = p;
    while (n) {
        ssize_t r = pread(fd, c, n, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0) {
            errno = 0; /* short file: reported as truncation */
            return -1;
        }
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int fail(ritem *it, int code, int err, const char *msg)
{
    it->code = code;
    it->err = err;
    snprintf(it->msg, sizeof(it->msg), "%s", msg);
    return -1;
}

static int io_fail(ritem *it, const char *what)
{
    if (errno == 0)
        return fail(it, RD_IO, 0, "file is shorter than the metadata says "
                                 "(truncated?)");
    char m[96];
    snprintf(m, sizeof(m), "%s failed", what);
    return fail(it, RD_IO, errno, m);
}

int dcpx_ritem_fail(ritem *it, int code, int err, const char *msg)
{
    return fail(it, code, err, msg);
}

int dcpx_ritem_io_fail(ritem *it, const char *what)
{
    return io_fail(it, what);
}

/* A window [wbeg, wbeg + wlen) of the archive is in memory at `w`. */
typedef struct {
    const unsigned char *w;
    uint64_t wbeg, wlen;
} window;

static const unsigned char *in_window(const window *win, uint64_t off,
                                      uint64_t len)
{
    if (off < win->wbeg || off + len > win->wbeg + win->wlen ||
        off + len < off)
        return NULL;
    return win->w + (off - win->wbeg);
}

static int check_record(ritem *it, const dcpx_tensor_record *rec)
{
    const dcpx_view *d = &it->dest;
    if (strcmp(rec->storage_type, it->storage_type) != 0) {
        char m[160];
        snprintf(m, sizeof(m), "archive holds a %s storage, metadata says %s",
                 rec->storage_type, it->storage_type);
        return fail(it, RD_CORRUPT, 0, m);
    }
    if (rec->ndim != d->ndim)
        return fail(it, RD_CORRUPT, 0, "archive tensor rank differs from the "
                                      "metadata");
    /* Unsigned, overflow-checked: a shape like (0, 2**62, 8) is a real
     * (empty) tensor, and strides come from the file (found by fuzzing). */
    uint64_t expect = 1, numel = 1;
    for (int i = rec->ndim - 1; i >= 0; i--) {
        if (rec->shape[i] != d->shape[i])
            return fail(it, RD_CORRUPT, 0, "archive tensor shape differs from "
                                          "the metadata");
        if (rec->shape[i] > 1 && (uint64_t)rec->stride[i] != expect)
            return fail(it, RD_FALLBACK, 0, "non-contiguous saved tensor");
        uint64_t dim = rec->shape[i] > 1 ? (uint64_t)rec->shape[i] : 1;
        if (i > 0 && __builtin_mul_overflow(expect, dim, &expect))
            return fail(it, RD_CORRUPT, 0, "archive tensor shape overflows");
        numel *= (uint64_t)rec->shape[i];
    }
    uint64_t storage_numel = rec->storage_numel;
    if (rec->numel_in_bytes)
        storage_numel /= d->itemsize ? d->itemsize : 1;
    if (rec->storage_offset != 0 || storage_numel != numel)
        return fail(it, RD_FALLBACK, 0, "saved tensor is a view of a larger "
                                       "storage");
    return 0;
}

/* Whether the archive's tensor bytes are in the other byte order than
 * this host's: its byteorder record says "big" or "little" (torch writes
 * sys.byteorder there); none means little, as torch assumes.  The record
 * must lie in the head window (torch writes it right after data.pkl);
 * anything else is left to torch.load. */
static int archive_swaps(const window *head, const unsigned char *cd,
                         uint64_t cd_len, int *swap, const char **why)
{
    uint64_t lho, len, doff;
    const unsigned char *p;
    int big;
    int found = dcpx_zip_find_byteorder(cd, (size_t)cd_len, &lho, &len);
    *swap = 0;
    if (found == 0)
        return DCPX_PARSE_OK;
    if (found < 0 || !(p = in_window(head, lho, 30))) {
        *why = "byteorder record is not near the start of the archive";
        return DCPX_PARSE_UNSUPPORTED;
    }
    int rc = dcpx_zip_local_data_off(p, 30, &doff, why);
    if (rc != DCPX_PARSE_OK)
        return rc;
    if (!(p = in_window(head, lho + doff, len))) {
        *why = "byteorder record is not near the start of the archive";
        return DCPX_PARSE_UNSUPPORTED;
    }
    if (len == 6 && memcmp(p, "little", 6) == 0)
        big = 0;
    else if (len == 3 && memcmp(p, "big", 3) == 0)
        big = 1;
    else {
        *why = "byteorder record is neither 'little' nor 'big'";
        return DCPX_PARSE_CORRUPT;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    *swap = !big;
#else
    *swap = big;
#endif
    return DCPX_PARSE_OK;
}

/* Reverse the bytes of each `size`-byte element of p[0 .. n), in place
 * (torch's UntypedStorage._byteswap). */
void dcpx_byteswap(unsigned char *p, uint64_t n, uint32_t size)
{
    if (size == 2) {
        for (uint64_t i = 0; i + 2 <= n; i += 2) {
            uint16_t v;
            memcpy(&v, p + i, 2);
            v = __builtin_bswap16(v);
            memcpy(p + i, &v, 2);
        }
    }
    else if (size == 4) {
        for (uint64_t i = 0; i + 4 <= n; i += 4) {
            uint32_t v;
            memcpy(&v, p + i, 4);
            v = __builtin_bswap32(v);
            memcpy(p + i, &v, 4);
        }
    }
    else if (size == 8) {
        for (uint64_t i = 0; i + 8 <= n; i += 8) {
            uint64_t v;
            memcpy(&v, p + i, 8);
            v = __builtin_bswap64(v);
            memcpy(p + i, &v, 8);
        }
    }
    else if (size > 1) {
        for (uint64_t i = 0; i + size <= n; i += size)
            for (uint32_t a = 0, b = size - 1; a < b; a++, b--) {
                unsigned char t = p[i + a];
                p[i + a] = p[i + b];
                p[i + b] = t;
            }
    }
}

/* The bytes each swapped unit spans for a record's dtype: the element
 * size, or half of it for complex types (torch swaps each component). */
static uint32_t swap_unit(const ritem *it, const dcpx_tensor_record *rec)
{
    uint32_t size = it->dest.itemsize;
    if (strstr(rec->storage_type, "omplex") != NULL)  /* Complex*Storage, complex32 */
        size /= 2;
    return size;
}

/* Read one archive: from `mem` if its L bytes are there already (a run),
 * else from its file. */
/* A raw item (storage type ""): the tensor's bytes themselves lie at
 * [offset, offset + length) (a safetensors data file, dcpx/formats/safetensors.py),
 * with no record around them and no CRC to check. */
static int read_raw(rjob *job, ritem *it, const unsigned char *mem)
{
    if (it->length != it->dest.nbytes)
        return fail(it, RD_CORRUPT, 0, "raw tensor extent does not match its "
                                      "shape and dtype");
    if (it->length == 0)
        return 0;
    if (mem != NULL) {
        memcpy(it->dest.data, mem, it->length);
        return 0;
    }
    for (uint64_t done = 0; done < it->length; done += CHUNK) {
        size_t n = it->length - done < CHUNK ? (size_t)(it->length - done) : CHUNK;
        if (dcpx_pread_all(job->fds[it->file], it->dest.data + done, n,
                      it->offset + done) < 0)
            return io_fail(it, "read");
    }
    return 0;
}

int dcpx_archive_locate(int fd, int verify, ritem *it, unsigned char *scratch,
                        const unsigned char *mem, dcpx_archive_loc *loc)
{
    const uint64_t L = it->length;
    window head, tail;
    const char *why = "";
    uint64_t cd_off, cd_len, pkl_lho, pkl_len, data_lho, data_len, doff;
    uint32_t pkl_crc, data_crc;
    dcpx_tensor_record rec;
    const unsigned char *p, *cd = NULL;
    int rc, swap = 0;

    if (mem == NULL && L <= 2 * WINDOW) {
        if (dcpx_pread_all(fd, scratch, L, it->offset) < 0)
            return io_fail(it, "read");
        mem = scratch;
    }
    if (mem != NULL) {
        head.w = tail.w = mem;
        head.wbeg = tail.wbeg = 0;
        head.wlen = tail.wlen = L;
    }
    else {
        head.w = scratch;
        head.wbeg = 0;
        head.wlen = WINDOW;
        tail.w = scratch + WINDOW;
        tail.wbeg = L - WINDOW;
        tail.wlen = WINDOW;
        if (dcpx_pread_all(fd, scratch, WINDOW, it->offset) < 0 ||
            dcpx_pread_all(fd, scratch + WINDOW, WINDOW, it->offset + L - WINDOW) < 0)
            return io_fail(it, "read");
    }
    rc = dcpx_zip_find_cd(tail.w, tail.wlen, L, &cd_off, &cd_len, &why);
    if (rc == DCPX_PARSE_OK && !(p = in_window(&tail, cd_off, cd_len))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "central directory larger than the read window";
    }
    if (rc == DCPX_PARSE_OK) {
        cd = p;
        rc = dcpx_zip_scan_cd(p, cd_len, L, &pkl_lho, &pkl_len, &pkl_crc,
                              &data_lho, &data_len, &data_crc, &why);
    }
    if (rc == DCPX_PARSE_OK)
        rc = archive_swaps(&head, cd, cd_len, &swap, &why);
    if (rc == DCPX_PARSE_OK && !(p = in_window(&head, pkl_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        !(p = in_window(&head, pkl_lho + doff, pkl_len))) {
        rc = pkl_lho + doff + pkl_len > L ? DCPX_PARSE_CORRUPT
                                          : DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl lies outside the archive window";
    }
    if (rc == DCPX_PARSE_OK && verify && pkl_crc &&
        dcpx_crc32(0, p, pkl_len) != pkl_crc)
        return fail(it, RD_CRC, 0, "CRC-32 mismatch in data.pkl");
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_pickle_parse_tensor(p, pkl_len, &rec, &why);
    if (rc == DCPX_PARSE_OK && check_record(it, &rec) < 0)
        return -1;
    if (rc == DCPX_PARSE_OK && data_len != it->dest.nbytes) {
        rc = DCPX_PARSE_CORRUPT;
        why = "tensor record size does not match its shape and dtype";
    }
    if (rc == DCPX_PARSE_OK && !(p = in_window(&head, data_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data/0 is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        (data_lho + doff > L || data_len > L - data_lho - doff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "tensor data runs past the end of the archive";
    }
    if (rc != DCPX_PARSE_OK)
        return fail(it, rc == DCPX_PARSE_UNSUPPORTED ? RD_FALLBACK : RD_CORRUPT,
                    0, why);
    loc->at = data_lho + doff;
    loc->len = data_len;
    loc->crc = data_crc;
    loc->swap = swap ? swap_unit(it, &rec) : 0;
    loc->in_mem = mem != NULL;
    return 0;
}

int dcpx_archive_check_crc(ritem *it, uint32_t recorded, uint32_t crc)
{
    /* A zero CRC field means "not recorded" (torch with CRC writing off). */
    if (recorded != 0 && crc != recorded) {
        char m[160];
        snprintf(m, sizeof(m), "CRC-32 mismatch in tensor data: recorded "
                 "%08x, computed %08x", recorded, crc);
        return fail(it, RD_CRC, 0, m);
    }
    return 0;
}

static int read_archive(rjob *job, ritem *it, scratch *s,
                        const unsigned char *mem)
{
    int fd = job->fds[it->file];
    dcpx_archive_loc loc;

    if (it->storage_type[0] == '\0')
        return read_raw(job, it, mem);
    if (mem == NULL && it->length <= WHOLE_MAX) {
        if (dcpx_pread_all(fd, s->buf, it->length, it->offset) < 0)
            return io_fail(it, "read");
        mem = s->buf;
    }
    if (dcpx_archive_locate(fd, job->verify, it, s->buf, mem, &loc) < 0)
        return -1;

    /* The bytes: from the buffer, or pread straight into the tensor. */
    const uint64_t at = loc.at, data_len = loc.len;
    uint32_t crc = 0;
    if (data_len == 0) {
        /* empty tensor: its data pointer may be NULL */
    }
    else if (mem != NULL) {
        if (job->verify)
            crc = dcpx_crc32_copy(0, it->dest.data, mem + at, data_len);
        else
            memcpy(it->dest.data, mem + at, data_len);
    }
    else {
        for (uint64_t done = 0; done < data_len; done += CHUNK) {
            size_t n = data_len - done < CHUNK ? (size_t)(data_len - done) : CHUNK;
            if (dcpx_pread_all(fd, it->dest.data + done, n, it->offset + at + done) < 0)
                return io_fail(it, "read");
            if (job->verify)
                crc = dcpx_crc32(crc, it->dest.data + done, n);
        }
    }
    if (job->verify && dcpx_archive_check_crc(it, loc.crc, crc) < 0)
        return -1;
    /* After the CRC, which is of the bytes as stored. */
    if (loc.swap && data_len)
        dcpx_byteswap((unsigned char *)it->dest.data, data_len, loc.swap);
    return 0;
}

static int read_one(rjob *job, ritem *it, scratch *s)
{
    return read_archive(job, it, s, NULL);
}

/* Read a run of items (order[a .. b)): one item alone, or several small
 * archives of one file through one pread into s->run.  A run that cannot be
 * read whole (a short file) is read item by item, so that each reports its
 * own error. */
static void read_run(rjob *job, Py_ssize_t a, Py_ssize_t b, scratch *s)
{
    ritem *first = &job->items[job->order[a]];
    int fd = job->fds[first->file];
    if (fd < 0) {
        for (Py_ssize_t k = a; k < b; k++) {
            ritem *it = &job->items[job->order[k]];
            if (it->code != RD_OK)
                continue;
            if (job->fwhy[it->file] != NULL)
                fail(it, RD_CORRUPT, 0, job->fwhy[it->file]);
            else
                fail(it, RD_IO, -fd - 1, "open failed");
        }
        return;
    }
    if (b - a > 1 && s->run == NULL)
        s->run = malloc(RUN_MAX);
    if (b - a > 1 && s->run != NULL) {
        uint64_t beg = first->offset, end = beg;
        for (Py_ssize_t k = a; k < b; k++) {
            ritem *it = &job->items[job->order[k]];
            if (it->offset + it->length > end)
                end = it->offset + it->length;
        }
        if (dcpx_pread_all(fd, s->run, end - beg, beg) == 0) {
            for (Py_ssize_t k = a; k < b; k++) {
                ritem *it = &job->items[job->order[k]];
                if (it->code == RD_OK)
                    read_archive(job, it, s, s->run + (it->offset - beg));
            }
            return;
        }
    }
    for (Py_ssize_t k = a; k < b; k++) {
        ritem *it = &job->items[job->order[k]];
        if (it->code == RD_OK)
            read_one(job, it, s);
    }
}

static void *rworker(void *arg)
{
    rjob *job = arg;
    scratch s;
    s.buf = malloc(WHOLE_MAX > 2 * WINDOW ? WHOLE_MAX : 2 * WINDOW);
    s.run = NULL;
    for (;;) {
        long r = atomic_fetch_add(&job->next, 1);
        if (r >= job->nruns)
            break;
        if (s.buf == NULL) {
            for (Py_ssize_t k = job->runs[r]; k < job->runs[r + 1]; k++)
                fail(&job->items[job->order[k]], RD_IO, ENOMEM, "out of memory");
            continue;
        }
        read_run(job, job->runs[r], job->runs[r + 1], &s);
    }
    free(s.buf);
    free(s.run);
    return NULL;
}

typedef struct {
    Py_ssize_t file;
    uint64_t offset;
    Py_ssize_t index;
} okey;

static int okey_cmp(const void *pa, const void *pb)
{
    const okey *x = pa, *y = pb;
    if (x->file != y->file)
        return x->file < y->file ? -1 : 1;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* Fill job->order (items by file and offset) and job->runs.  -1 without
 * memory (no exception set). */
static int make_runs(rjob *job)
{
    Py_ssize_t n = job->n;
    int given = job->order != NULL;  /* a permutation of 0 .. n - 1 from the caller */
    if (!given)
        job->order = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    job->runs = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    if (job->order == NULL || job->runs == NULL)
        return -1;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!given)
            job->order[i] = i;
        if (i > 0) {
            const ritem *p = &job->items[job->order[i - 1]], *q = &job->items[job->order[i]];
            if (q->file < p->file || (q->file == p->file && q->offset < p->offset))
                sorted = 0;
        }
    }
    if (!sorted) {
        okey *keys = PyMem_RawMalloc(sizeof(okey) * (size_t)n);
        if (keys == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            keys[i].file = job->items[i].file;
            keys[i].offset = job->items[i].offset;
            keys[i].index = i;
        }
        qsort(keys, (size_t)n, sizeof(okey), okey_cmp);
        for (Py_ssize_t i = 0; i < n; i++)
            job->order[i] = keys[i].index;
        PyMem_RawFree(keys);
    }
    Py_ssize_t nr = 0;
    uint64_t beg = 0, end = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        const ritem *it = &job->items[job->order[k]];
        const ritem *prev = k ? &job->items[job->order[k - 1]] : NULL;
        uint64_t e = it->offset + it->length;
        int join = prev != NULL && prev->file == it->file &&
                   prev->length <= WHOLE_MAX && it->length <= WHOLE_MAX &&
                   e >= it->offset && it->offset <= end + RUN_GAP &&
                   (e > end ? e : end) - beg <= RUN_MAX;
        if (!join) {
            job->runs[nr++] = k;
            beg = it->offset;
            end = e;
        }
        else if (e > end) {
            end = e;
        }
    }
    job->runs[nr] = n;
    job->nruns = nr;
    return 0;
}

/* Destinations that share bytes (several keys bound to one tensor, as tied
 * weights are; overlapping views of one storage): read at once by two
 * workers, each archive's bytes would land over the other's, and a CRC
 * computed from the destination after its pread would see the other's
 * bytes (a false mismatch) or a mix of both would be left.  Such items
 * are read one after another once the workers are done, in the order
 * torch's FileSystemReader copies them (the files in the order they first
 * appear among the items, then the items' own order), so that the last
 * one wins as it does there.  Sets job->serial (NULL when no destination
 * overlaps another, the rule); -1 without memory. */
typedef struct {
    uintptr_t beg, end;
    Py_ssize_t index;
} span;

static int span_cmp(const void *pa, const void *pb)
{
    const span *x = pa, *y = pb;
    if (x->beg != y->beg)
        return x->beg < y->beg ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

static int find_overlaps(rjob *job)
{
    Py_ssize_t n = 0, m = 0;
    job->serial = NULL;
    job->nserial = 0;
    if (job->n < 2)
        return 0;
    span *sp = PyMem_RawMalloc(sizeof(span) * (size_t)job->n);
    if (sp == NULL)
        return -1;
    int sorted = 1;
    /* in the reads' order (files, offsets): the order the tensors were
     * made in, as a rule, so their addresses mostly ascend */
    for (Py_ssize_t k = 0; k < job->n; k++) {
        Py_ssize_t i = job->order[k];
        const ritem *it = &job->items[i];
        if (it->code != RD_OK || it->dest.nbytes == 0)
            continue;
        sp[n].beg = (uintptr_t)it->dest.data;
        sp[n].end = sp[n].beg + (uintptr_t)it->dest.nbytes;
        sp[n].index = i;
        if (n > 0 && sp[n].beg < sp[n - 1].beg)
            sorted = 0;
        n++;
    }
    if (!sorted)
        qsort(sp, (size_t)n, sizeof(span), span_cmp);
    /* clusters of spans that overlap, in address order: a cluster of two
     * or more is read serially (one that overlaps none is not) */
    uintptr_t end = 0;
    Py_ssize_t first = 0;
    for (Py_ssize_t k = 0; k <= n; k++) {
        if (k < n && k > 0 && sp[k].beg < end) {
            if (sp[k].end > end)
                end = sp[k].end;
            continue;
        }
        if (k - first > 1) {         /* sp[first .. k) overlap: mark them */
            for (Py_ssize_t j = first; j < k; j++)
                sp[m++].index = sp[j].index;
        }
        if (k < n) {
            first = k;
            end = sp[k].end;
        }
    }
    Py_ssize_t *serial = m ? PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)m) : NULL;
    Py_ssize_t *rank = m ? PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(job->nfiles + 1))
                         : NULL;
    if (m == 0 || serial == NULL || rank == NULL) {
        PyMem_RawFree(sp);
        PyMem_RawFree(serial);
        PyMem_RawFree(rank);
        return m == 0 ? 0 : -1;
    }
    /* their order: (rank of the item's file, item index) */
    for (Py_ssize_t f = 0; f < job->nfiles; f++)
        rank[f] = -1;
    for (Py_ssize_t i = 0, r = 0; i < job->n; i++)
        if (rank[job->items[i].file] < 0)
            rank[job->items[i].file] = r++;
    for (Py_ssize_t j = 0; j < m; j++)
        sp[j].beg = (uintptr_t)rank[job->items[sp[j].index].file];
    qsort(sp, (size_t)m, sizeof(span), span_cmp);
    for (Py_ssize_t j = 0; j < m; j++)
        serial[j] = sp[j].index;
    PyMem_RawFree(sp);
    PyMem_RawFree(rank);
    for (Py_ssize_t j = 0; j < m; j++)
        job->items[serial[j]].code = RD_SERIAL;  /* the workers skip them */
    job->serial = serial;
    job->nserial = m;
    return 0;
}

/* The items find_overlaps set apart, one after another (files open). */
static void read_serial(rjob *job)
{
    scratch s;
    if (job->nserial == 0)
        return;
    s.buf = malloc(WHOLE_MAX > 2 * WINDOW ? WHOLE_MAX : 2 * WINDOW);
    s.run = NULL;
    for (Py_ssize_t j = 0; j < job->nserial; j++) {
        ritem *it = &job->items[job->serial[j]];
        int fd = job->fds[it->file];
        it->code = RD_OK;
        if (s.buf == NULL)
            fail(it, RD_IO, ENOMEM, "out of memory");
        else if (fd < 0 && job->fwhy[it->file] != NULL)
            fail(it, RD_CORRUPT, 0, job->fwhy[it->file]);
        else if (fd < 0)
            fail(it, RD_IO, -fd - 1, "open failed");
        else
            read_one(job, it, &s);
    }
    free(s.buf);
}

static void run_threads(rjob *job, int nthreads)
{
    atomic_store(&job->next, 0);
    /* only the files some item reads: a plan over a checkpoint's every
     * file (read_plan_md) opens the few this rank reads, not R of them */
    for (Py_ssize_t f = 0; f < job->nfiles; f++)
        job->fds[f] = -EBADF - 1;
    for (Py_ssize_t i = 0; i < job->n; i++) {
        Py_ssize_t f = job->items[i].file;
        if (job->fds[f] != -EBADF - 1)
            continue;
        job->fds[f] = dcpx_open_regular(job->paths[f], &job->fwhy[f]);
        if (job->fds[f] < 0)
            job->fds[f] = -errno - 1; /* reported per item */
    }
    dcpx_run_workers(rworker, job, nthreads);
    read_serial(job);
    for (Py_ssize_t f = 0; f < job->nfiles; f++)
        if (job->fds[f] >= 0)
            close(job->fds[f]);
}

static int parse_item(rjob *job, ritem *it, PyObject *obj)
{
    PyObject *dest;
    const char *stype;
    Py_ssize_t slen;
    unsigned long long off, len;

    if (!PyArg_ParseTuple(obj, "nKKOs#;dcpx: read item must be (file, "
                               "offset, length, dest, storage_type)",
                          &it->file, &off, &len, &dest, &stype, &slen))
        return -1;
    if (it->file < 0 || it->file >= job->nfiles) {
        PyErr_SetString(PyExc_IndexError, "dcpx: file index out of range");
        return -1;
    }
    if ((size_t)slen >= sizeof(it->storage_type)) {
        PyErr_SetString(PyExc_ValueError, "dcpx: storage type name too long");
        return -1;
    }
    memcpy(it->storage_type, stype, (size_t)slen + 1);
    it->offset = off;
    it->length = len;
    if (dcpx_view_from_object(dest, &it->dest, 1) < 0)
        return -1;
    if ((it->dest.device_type != DCPX_DL_CPU &&
         it->dest.device_type != DCPX_DL_CUDA_HOST) ||
        !it->dest.contiguous || it->dest.ndim > 16)
        fail(it, RD_FALLBACK, 0, "destination is not contiguous host memory");
    return 0;
}

static void free_job(rjob *job)
{
    for (Py_ssize_t i = 0; i < job->n; i++)
        dcpx_view_release(&job->items[i].dest);
    for (Py_ssize_t i = 0; i < job->nfiles; i++)
        PyMem_RawFree(job->paths ? job->paths[i] : NULL);
    PyMem_RawFree(job->paths);
    PyMem_RawFree(job->fds);
    PyMem_RawFree(job->fwhy);
    PyMem_RawFree(job->items);
    PyMem_RawFree(job->order);
    PyMem_RawFree(job->runs);
}

static int parse_paths(rjob *job, PyObject *paths)
{
    PyObject *fast = PySequence_Fast(paths, "dcpx: paths must be a sequence");
    if (fast == NULL)
        return -1;
    job->nfiles = PySequence_Fast_GET_SIZE(fast);
    job->paths = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(char *));
    job->fds = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(int));
    job->fwhy = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(char *));
    if (job->paths == NULL || job->fds == NULL || job->fwhy == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < job->nfiles; i++) {
        PyObject *b;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &b)) {
            Py_DECREF(fast);
            return -1;
        }
        size_t n = (size_t)PyBytes_GET_SIZE(b) + 1;
        job->paths[i] = PyMem_RawMalloc(n);
        if (job->paths[i] != NULL)
            memcpy(job->paths[i], PyBytes_AS_STRING(b), n);
        Py_DECREF(b);
        if (job->paths[i] == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* Run the job without the GIL; the failures as a list (items' own order). */
static PyObject *execute(rjob *job, int nthreads)
{
    PyObject *out;
    if (job->order == NULL && make_runs(job) < 0)
        return PyErr_NoMemory();
    if (find_overlaps(job) < 0)
        return PyErr_NoMemory();
    if (nthreads > job->nruns)
        nthreads = job->nruns > 0 ? (int)job->nruns : 1;
    Py_BEGIN_ALLOW_THREADS
    run_threads(job, nthreads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(job->serial);
    job->serial = NULL;
    job->nserial = 0;
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < job->n; i++) {
        ritem *it = &job->items[i];
        if (it->code == RD_OK)
            continue;
        PyObject *t = Py_BuildValue("(niis)", i, it->code, it->err, it->msg);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

PyObject *dcpx_read_items(PyObject *Py_UNUSED(module), PyObject *args,
                          PyObject *kwds)
{
    static char *kwlist[] = {"paths", "items", "threads", "verify", NULL};
    PyObject *paths, *items, *fast = NULL, *out = NULL;
    int nthreads = 1, verify = 1;
    rjob job;

    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|ip", kwlist, &paths,
                                     &items, &nthreads, &verify))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    job.verify = verify;
    if (parse_paths(&job, paths) < 0)
        goto done;
    fast = PySequence_Fast(items, "dcpx: items must be a sequence");
    if (fast == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    job.items = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof(ritem));
    if (job.items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        job.n = i + 1;
        if (parse_item(&job, &job.items[i], PySequence_Fast_GET_ITEM(fast, i)) < 0)
            goto done;
    }
    out = execute(&job, nthreads);
done:
    Py_XDECREF(fast);
    free_job(&job);
    return out;
}

/* ---------------------------------------------------------- read plans */

typedef struct {
    rjob job;                        /* paths, items (no destinations), runs */
    Py_ssize_t *pos;                 /* per item: index of its destination */
    int *ndim;
    int *dtype_code;
    uint32_t *itemsize;
    Py_ssize_t *shape_at;            /* per item: where its shape starts in shape */
    int64_t *shape;                  /* every item's dimensions, back to back */
    size_t shape_len, shape_cap;
    atomic_int busy;                 /* job.items in use by a run */
} rplan;

#define PLAN_NAME "dcpx.read_plan"

static void free_plan(rplan *p)
{
    if (p == NULL)
        return;
    free_job(&p->job);
    PyMem_RawFree(p->pos);
    PyMem_RawFree(p->ndim);
    PyMem_RawFree(p->dtype_code);
    PyMem_RawFree(p->itemsize);
    PyMem_RawFree(p->shape_at);
    PyMem_RawFree(p->shape);
    PyMem_RawFree(p);
}

static void plan_capsule_free(PyObject *cap)
{
    free_plan(PyCapsule_GetPointer(cap, PLAN_NAME));
}

/* Whether obj() is False. */
static int method_false(PyObject *obj, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(r);
    return r == Py_False;
}

/* Take item i's destination from values; 0 if it is not what the plan was
 * made for (no exception set). */
static int bind_dest(rplan *p, Py_ssize_t i, ritem *it, PyObject *values,
                     PyObject *exporter, PyObject *types, int record)
{
    static PyObject *is_neg, *is_conj;
    if (is_neg == NULL && (is_neg = PyUnicode_InternFromString("is_neg")) == NULL)
        return -1;
    if (is_conj == NULL && (is_conj = PyUnicode_InternFromString("is_conj")) == NULL)
        return -1;
    if (p->pos[i] >= PySequence_Fast_GET_SIZE(values))
        return 0;
    PyObject *v = PySequence_Fast_GET_ITEM(values, p->pos[i]);
    int typed = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); k++)
        typed |= (PyObject *)Py_TYPE(v) == PyTuple_GET_ITEM(types, k);
    /* The exporter shares a tensor's memory whatever its neg / conj bit
     * says; such a tensor must take the torch path. */
    if (!typed || !method_false(v, is_neg) ||
        (!record && p->dtype_code[i] == 5 /* kDLComplex */ && !method_false(v, is_conj)))
        return 0;
    PyObject *cap = PyObject_CallOneArg(exporter, v);
    if (cap == NULL) {
        PyErr_Clear();
        return 0;
    }
    int rc = dcpx_view_from_object(cap, &it->dest, 1);
    Py_DECREF(cap);
    if (rc < 0) {
        PyErr_Clear();
        return 0;
    }
    const dcpx_view *d = &it->dest;
    /* read_plan: the dtype is known now (only a complex tensor has a conj bit) */
    if (record && d->dtype_code == 5 && !method_false(v, is_conj)) {
        dcpx_view_release(&it->dest);
        return 0;
    }
    if (record && d->ndim <= 16) {   /* read_plan: what later runs require */
        if (p->shape_len + (size_t)d->ndim > p->shape_cap) {
            size_t cap = 2 * p->shape_cap + 64;
            int64_t *grown = PyMem_RawRealloc(p->shape, cap * sizeof(int64_t));
            if (grown == NULL) {
                dcpx_view_release(&it->dest);
                PyErr_NoMemory();
                return -1;
            }
            p->shape = grown;
            p->shape_cap = cap;
        }
        p->ndim[i] = d->ndim;
        p->dtype_code[i] = d->dtype_code;
        p->itemsize[i] = d->itemsize;
        p->shape_at[i] = (Py_ssize_t)p->shape_len;
        for (int k = 0; k < d->ndim; k++)
            p->shape[p->shape_len++] = d->shape[k];
    }
    if (!(d->device_type == DCPX_DL_CPU || d->device_type == DCPX_DL_CUDA_HOST) ||
        !d->contiguous || d->ndim != p->ndim[i] || d->dtype_code != p->dtype_code[i] ||
        d->itemsize != p->itemsize[i] ||
        (d->ndim && memcmp(d->shape, &p->shape[p->shape_at[i]],
                           sizeof(int64_t) * (size_t)d->ndim) != 0)) {
        dcpx_view_release(&it->dest);
        return 0;
    }
    it->code = RD_OK;
    it->err = 0;
    it->msg[0] = '\0';
    return 1;
}

/* Allocate a plan's per-item arrays for up to n items. */
static int plan_alloc(rplan *p, Py_ssize_t n)
{
    size_t m = (size_t)(n ? n : 1);
    p->job.items = PyMem_RawCalloc(m, sizeof(ritem));
    p->pos = PyMem_RawCalloc(m, sizeof(Py_ssize_t));
    p->ndim = PyMem_RawCalloc(m, sizeof(int));
    p->dtype_code = PyMem_RawCalloc(m, sizeof(int));
    p->itemsize = PyMem_RawCalloc(m, sizeof(uint32_t));
    p->shape_at = PyMem_RawCalloc(m, sizeof(Py_ssize_t));
    if (!p->job.items || !p->pos || !p->ndim || !p->dtype_code || !p->itemsize ||
        !p->shape_at) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Plan item i: the archive at (file, off, len) of storage type stype
 * into values[pos]; its view kept if `keep`.  -1 error, 0 a destination
 * the plan cannot take, 1 planned. */
static int plan_item(rplan *p, Py_ssize_t i, Py_ssize_t file, uint64_t off, uint64_t len,
                     const char *stype, size_t slen, Py_ssize_t pos, PyObject *fv,
                     PyObject *exporter, PyObject *types, int keep)
{
    ritem *it = &p->job.items[i];
    it->file = file;
    p->pos[i] = pos;
    if (it->file < 0 || it->file >= p->job.nfiles || p->pos[i] < 0) {
        PyErr_SetString(PyExc_IndexError, "dcpx: plan item index out of range");
        return -1;
    }
    if (slen >= sizeof(it->storage_type)) {
        PyErr_SetString(PyExc_ValueError, "dcpx: storage type name too long");
        return -1;
    }
    memcpy(it->storage_type, stype, slen + 1);
    it->offset = off;
    it->length = len;
    int rc = bind_dest(p, i, it, fv, exporter, types, 1);
    if (rc > 0 && !keep)
        dcpx_view_release(&it->dest);
    return rc;
}

/* read_plan_md(index, paths, keys, values, exporter, types, allow_partial,
 *              threads=0, verify=True, check=None)
 *   -> (plan, byte_keys, failures); None when the metadata does not fit a plan (a
 *   missing key, not one whole chunk, another dtype or shape, a dtype not
 *   read in place, a value of another type); False when a destination
 *   cannot be read into in place.  As _readplan.direct_plan with the
 *   Metadata objects, from md_index's tables (mdindex.c).  With threads >
 *   0 the plan is also run at once, through the destinations it has just
 *   taken (failures as read_plan_run; else failures is None).  check: a
 *   callable given the indices of the files the plan reads (ascending)
 *   before any is opened; a false answer makes it None, an exception is
 *   raised. */
PyObject *dcpx_read_plan_md(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"index", "paths", "keys", "values", "exporter", "types",
                             "allow_partial", "threads", "verify", "check", NULL};
    PyObject *icap, *paths, *keys, *values, *exporter, *types, *fk = NULL, *fv = NULL;
    PyObject *check = Py_None;
    PyObject *out = NULL, *byte_keys = NULL;
    static PyObject *dtype_name, *shape_name;
    PyObject *failures = NULL;
    int partial, nthreads = 0, verify = 1, refused = 0;
    Py_ssize_t cursor = 0, ni = 0, *by_entry = NULL, *order = NULL;
    dcpx_md_tensor *md = NULL;
    rplan *p = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO!p|ipO:read_plan_md", kwlist, &icap,
                                     &paths, &keys, &values, &exporter, &PyTuple_Type,
                                     &types, &partial, &nthreads, &verify, &check))
        return NULL;
    if (nthreads < 0 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 0..64");
        return NULL;
    }
    if (dtype_name == NULL && (dtype_name = PyUnicode_InternFromString("dtype")) == NULL)
        return NULL;
    if (shape_name == NULL && (shape_name = PyUnicode_InternFromString("shape")) == NULL)
        return NULL;
    const dcpx_mdindex *ix = dcpx_mdindex_get(icap);
    if (ix == NULL)
        return NULL;
    p = PyMem_RawCalloc(1, sizeof(rplan));
    if (p == NULL)
        return PyErr_NoMemory();
    if (parse_paths(&p->job, paths) < 0)
        goto done;
    if (p->job.nfiles != dcpx_mdindex_nfiles(ix)) {
        PyErr_SetString(PyExc_ValueError, "dcpx: read_plan_md: one path per file");
        goto done;
    }
    fk = PySequence_Fast(keys, "dcpx: keys must be a sequence");
    fv = fk ? PySequence_Fast(values, "dcpx: values must be a sequence") : NULL;
    if (fv == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fk), nst = dcpx_mdindex_nstorage(ix);
    if (PySequence_Fast_GET_SIZE(fv) != n) {
        PyErr_SetString(PyExc_ValueError, "dcpx: read_plan_md: one value per key");
        goto done;
    }
    md = PyMem_RawMalloc(sizeof(dcpx_md_tensor) * (size_t)(n ? n : 1));
    by_entry = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(nst ? nst : 1));
    order = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (md == NULL || by_entry == NULL || order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (plan_alloc(p, n) < 0 || (byte_keys = PyList_New(0)) == NULL)
        goto done;
    /* 1. The keys, in the state dict's order, against the metadata only
     * (as direct_plan's loop; a missing key or a tensor not saved whole
     * makes it None whatever the destinations are). */
    for (Py_ssize_t pos = 0; pos < n; pos++) {
        PyObject *key = PySequence_Fast_GET_ITEM(fk, pos);
        Py_ssize_t klen;
        const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &klen) : NULL;
        if (k == NULL) {
            PyErr_Clear();
            goto none;
        }
        int kind = dcpx_mdindex_find(ix, k, klen, &cursor, &md[ni]);
        if (kind == 0) {
            if (partial)
                continue;
            goto none;
        }
        if (kind == DCPX_MD_BYTES) {
            if (PyList_Append(byte_keys, key) < 0)
                goto done;
            continue;
        }
        if (!md[ni].whole || md[ni].storage_type == NULL || md[ni].entry >= nst)
            goto none;
        md[ni].pos = pos;
        ni++;
    }
    /* 2. The destinations, in the order of their archives in the files
     * (each storage entry is the whole chunk of one key at most): that is
     * the order their tensors were made in, as a rule, and the reads' own
     * order.  None if any does not match the metadata (its type, dtype,
     * shape), else False if any cannot be read into in place, as
     * direct_plan + read_plan decide. */
    for (Py_ssize_t e = 0; e < nst; e++)
        by_entry[e] = -1;
    for (Py_ssize_t i = 0; i < ni; i++)
        by_entry[md[i].entry] = i;
    Py_ssize_t no = 0;
    for (Py_ssize_t e = 0; e < nst; e++)
        if (by_entry[e] >= 0)
            order[no++] = by_entry[e];
    if (no != ni)    /* two keys with one entry (a key twice): not planned */
        goto none;
    p->job.n = ni;   /* items 0 .. ni - 1, the tensor keys in order */
    for (Py_ssize_t j = 0; j < ni; j++) {
        Py_ssize_t i = order[j];
        const dcpx_md_tensor *t = &md[i];
        PyObject *v = PySequence_Fast_GET_ITEM(fv, t->pos);
        int typed = 0;
        for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(types); q++)
            typed |= (PyObject *)Py_TYPE(v) == PyTuple_GET_ITEM(types, q);
        if (!typed)
            goto none;
        PyObject *dt = PyObject_GetAttr(v, dtype_name);
        if (dt == NULL) {
            PyErr_Clear();
            goto none;
        }
        Py_DECREF(dt);
        if (dt != t->dtype)
            goto none;
        int rc = plan_item(p, i, t->file, t->offset, t->length, t->storage_type,
                           strlen(t->storage_type), t->pos, fv, exporter, types,
                           nthreads > 0);
        if (rc < 0)
            goto done;
        if (rc > 0 && (p->ndim[i] != t->ndim ||
                       (t->ndim && memcmp(&p->shape[p->shape_at[i]], t->size,
                                          sizeof(int64_t) * (size_t)t->ndim) != 0)))
            goto none;
        if (rc == 0) {
            /* refused: still None if its shape differs from the metadata */
            PyObject *shape = PyObject_GetAttr(v, shape_name);
            int same = shape != NULL && PyTuple_Check(shape) &&
                       PyTuple_GET_SIZE(shape) == t->ndim;
            for (int d = 0; same && d < t->ndim; d++)
                same = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d)) == t->size[d];
            Py_XDECREF(shape);
            PyErr_Clear();
            if (!same)
                goto none;
            refused = 1;
        }
    }
    if (refused) {
        Py_INCREF(Py_False);
        out = Py_False;
        goto done;
    }
    /* the runs: in the order just used when it is the files' order
     * (make_runs checks, else sorts) */
    p->job.order = order;
    order = NULL;
    if (make_runs(&p->job) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (check != Py_None) {
        /* the files the plan reads, ascending, checked by the caller
         * before any is opened: false makes it None */
        PyObject *used = PyList_New(0);
        char *mark = used ? PyMem_RawCalloc((size_t)p->job.nfiles + 1, 1) : NULL;
        int bad = used == NULL || mark == NULL;
        for (Py_ssize_t i = 0; !bad && i < p->job.n; i++)
            mark[p->job.items[i].file] = 1;
        for (Py_ssize_t f = 0; !bad && f < p->job.nfiles; f++) {
            if (!mark[f])
                continue;
            PyObject *o = PyLong_FromSsize_t(f);
            bad = o == NULL || PyList_Append(used, o) < 0;
            Py_XDECREF(o);
        }
        PyMem_RawFree(mark);
        if (bad) {
            Py_XDECREF(used);
            if (!PyErr_Occurred())
                PyErr_NoMemory();
            goto done;
        }
        PyObject *r = PyObject_CallOneArg(check, used);
        Py_DECREF(used);
        int ok = r == NULL ? -1 : PyObject_IsTrue(r);
        Py_XDECREF(r);
        if (ok < 0)
            goto done;               /* (free_plan releases the views) */
        if (ok == 0)
            goto none;
    }
    if (nthreads > 0) {              /* run it through the views taken above */
        p->job.verify = verify;
        failures = execute(&p->job, nthreads);
        for (Py_ssize_t i = 0; i < p->job.n; i++)
            dcpx_view_release(&p->job.items[i].dest);
        if (failures == NULL)
            goto done;
    }
    else {
        Py_INCREF(Py_None);
        failures = Py_None;
    }
    PyObject *cap = PyCapsule_New(p, PLAN_NAME, plan_capsule_free);
    if (cap == NULL)
        goto done;
    p = NULL;
    out = Py_BuildValue("(NOO)", cap, byte_keys, failures);
    goto done;
none:
    Py_INCREF(Py_None);
    out = Py_None;
done:
    Py_XDECREF(failures);
    Py_XDECREF(byte_keys);
    Py_XDECREF(fk);
    Py_XDECREF(fv);
    PyMem_RawFree(md);
    PyMem_RawFree(by_entry);
    PyMem_RawFree(order);
    free_plan(p);
    return out;
}

PyObject *dcpx_read_plan(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *paths, *items, *values, *exporter, *types, *fi = NULL, *fv = NULL;
    PyObject *cap = NULL;
    rplan *p = PyMem_RawCalloc(1, sizeof(rplan));

    if (p == NULL)
        return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "OOOOO!:read_plan", &paths, &items, &values, &exporter,
                          &PyTuple_Type, &types))
        goto done;
    if (parse_paths(&p->job, paths) < 0)
        goto done;
    fi = PySequence_Fast(items, "dcpx: items must be a sequence");
    fv = fi ? PySequence_Fast(values, "dcpx: values must be a sequence") : NULL;
    if (fv == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fi);
    if (plan_alloc(p, n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        ritem *it = &p->job.items[i];
        const char *stype;
        Py_ssize_t slen;
        unsigned long long off, len;
        p->job.n = i + 1;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fi, i),
                              "nKKs#n;dcpx: plan item must be (file, offset, "
                              "length, storage_type, position)",
                              &it->file, &off, &len, &stype, &slen, &p->pos[i]))
            goto done;
        if (it->file < 0 || it->file >= p->job.nfiles || p->pos[i] < 0) {
            PyErr_SetString(PyExc_IndexError, "dcpx: plan item index out of range");
            goto done;
        }
        if ((size_t)slen >= sizeof(it->storage_type)) {
            PyErr_SetString(PyExc_ValueError, "dcpx: storage type name too long");
            goto done;
        }
        memcpy(it->storage_type, stype, (size_t)slen + 1);
        it->offset = off;
        it->length = len;
        int rc = bind_dest(p, i, it, fv, exporter, types, 1);
        if (rc < 0)
            goto done;
        dcpx_view_release(&it->dest);
        if (rc == 0) {                /* a destination the plan cannot take */
            Py_INCREF(Py_None);
            cap = Py_None;
            goto done;
        }
    }
    if (make_runs(&p->job) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    cap = PyCapsule_New(p, PLAN_NAME, plan_capsule_free);
    if (cap != NULL)
        p = NULL;
done:
    Py_XDECREF(fi);
    Py_XDECREF(fv);
    free_plan(p);
    return cap;
}

PyObject *dcpx_read_plan_run(PyObject *Py_UNUSED(module), PyObject *args,
                             PyObject *kwds)
{
    static char *kwlist[] = {"plan", "values", "exporter", "types", "threads",
                             "verify", NULL};
    PyObject *cap, *values, *exporter, *types, *fast = NULL, *out = NULL;
    int nthreads = 1, verify = 1, own = 0;
    Py_ssize_t bound = 0;
    rplan *p;
    rjob job;

    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!|ip:read_plan_run", kwlist,
                                     &cap, &values, &exporter, &PyTuple_Type,
                                     &types, &nthreads, &verify))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    p = PyCapsule_GetPointer(cap, PLAN_NAME);
    if (p == NULL)
        return NULL;
    fast = PySequence_Fast(values, "dcpx: values must be a sequence");
    if (fast == NULL)
        return NULL;
    job = p->job;                    /* shares paths, order, runs: read only */
    job.verify = verify;
    job.fds = PyMem_RawCalloc((size_t)job.nfiles + 1, sizeof(int));
    job.fwhy = PyMem_RawCalloc((size_t)job.nfiles + 1, sizeof(char *));
    if (atomic_exchange(&p->busy, 1) != 0) {   /* another thread runs it */
        own = 1;
        job.items = PyMem_RawMalloc(sizeof(ritem) * (size_t)(job.n ? job.n : 1));
        if (job.items != NULL)
            memcpy(job.items, p->job.items, sizeof(ritem) * (size_t)job.n);
    }
    if (job.fds == NULL || job.fwhy == NULL || job.items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; bound < job.n; bound++) {
        int rc = bind_dest(p, bound, &job.items[bound], fast, exporter, types, 0);
        if (rc < 0)
            goto done;
        if (rc == 0) {
            Py_INCREF(Py_None);
            out = Py_None;
            goto done;
        }
    }
    out = execute(&job, nthreads);
done:
    for (Py_ssize_t i = 0; i < bound; i++)
        dcpx_view_release(&job.items[i].dest);
    PyMem_RawFree(job.fds);
    PyMem_RawFree(job.fwhy);
    if (own)
        PyMem_RawFree(job.items);
    else
        atomic_store(&p->busy, 0);
    Py_DECREF(fast);
    return out;
}
