/* libFuzzer target for the real csrc/reader.c read_one(): the archive is put
 * in a (sparse) memfd and read_one preads it exactly as dcpx.load does,
 * through its own whole-archive or head/tail-window logic, check_record()
 * and the data copy into a destination "tensor" (a plain malloc'd block of
 * exactly the destination's size, so an overflowing copy is an ASan report).
 *
 * reader.c is #included so that its static functions can be called.  It
 * refers to the Python API (argument parsing in read_items), so this target
 * links libpython, but never initialises or calls it; dlpack.c is replaced by
 * two stubs below.
 *
 * Input: byte 0 flags (bit 0: verify CRCs off; bit 1: give the destination
 * a storage type that does not match the archive), bytes 1..8 a
 * little-endian gap G (masked to 2^40), then R (n bytes), split at h = n / 2:
 * the file is R[0:h] + G zero bytes + R[h:n] (length L = n + G).  Archives of
 * L <= 256 KiB are read whole, larger ones through 64 KiB windows.
 *
 * The destination is what a metadata consistent with the archive would ask
 * for: the shape and storage type of the archive's own pickle (found by a
 * first pass over the same bytes), when that is a shape a tensor can have
 * and its bytes are at most 16 MiB; otherwise a 4-element float32 tensor.
 *
 * Round-trip mode (flags bit 2): the input describes a tensor instead of an
 * archive -- byte 1 its dtype (an index into ITEMSIZE), byte 2 its rank
 * (mod 9), then 8 bytes (little-endian, sign bit cleared) per size, the rest
 * its bytes (repeated to fill it, at most 1 MiB so that both the one-read
 * and the windowed path are taken).  The archive is built by the writer's
 * own csrc/zipwrite.c, and read_one must then succeed and deliver exactly
 * those bytes: a shape torch can create that dcpx writes but cannot read
 * back is a finding too.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "../csrc/reader.c"
#include "emulate.h"

#include <sys/mman.h>

int dcpx_view_from_object(PyObject *obj, dcpx_view *out, int need_writable)
{
    (void)obj;
    (void)out;
    (void)need_writable;
    abort(); /* not reached: only read_items calls it */
}

void dcpx_view_release(dcpx_view *v) { (void)v; }

static int memfd = -1;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    dcpx_crc32_init();
    memfd = memfd_create("fuzz_reader", MFD_CLOEXEC);
    if (memfd < 0)
        abort();
    return 0;
}

static const struct {
    const char *name;
    uint32_t itemsize;
} ITEMSIZE[] = {
    {"FloatStorage", 4}, {"DoubleStorage", 8}, {"HalfStorage", 2},
    {"BFloat16Storage", 2}, {"LongStorage", 8}, {"IntStorage", 4},
    {"ShortStorage", 2}, {"CharStorage", 1}, {"ByteStorage", 1},
    {"BoolStorage", 1}, {"ComplexFloatStorage", 8},
    {"ComplexDoubleStorage", 16}, {"uint16", 2}, {"uint32", 4},
    {"uint64", 8}, {"complex32", 4}, {"float8_e4m3fn", 1},
    {"float8_e5m2", 1},
};

static uint32_t itemsize_of(const char *st)
{
    for (size_t i = 0; i < sizeof(ITEMSIZE) / sizeof(ITEMSIZE[0]); i++)
        if (strcmp(ITEMSIZE[i].name, st) == 0)
            return ITEMSIZE[i].itemsize;
    return 1;
}

static uint64_t rd64le(const uint8_t *p)
{
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = x << 8 | p[i];
    return x;
}

/* Whether torch would create a contiguous tensor of this shape (as
 * torch.empty does: sizes >= 0, the running product of the sizes fits in 64
 * unsigned bits, e.g. (2**63 - 1, 2, 0) is accepted, and every contiguous
 * stride fits in int64). */
static int tensor_can_have(const dcpx_tensor_record *rec)
{
    uint64_t prod = 1, stride = 1;
    for (int i = 0; i < rec->ndim; i++) {
        if (rec->shape[i] < 0 ||
            __builtin_mul_overflow(prod, (uint64_t)rec->shape[i], &prod))
            return 0;
    }
    for (int i = rec->ndim - 1; i > 0; i--) {
        uint64_t s = rec->shape[i] > 1 ? (uint64_t)rec->shape[i] : 1;
        if (__builtin_mul_overflow(stride, s, &stride) || stride > INT64_MAX)
            return 0;
    }
    return 1;
}

/* The bytes read_one will see, for the first pass. */
static int first_pass(uint64_t L, dcpx_tensor_record *rec)
{
    fz_result r;
    int rc;
    if (L <= WHOLE_MAX) {
        unsigned char *b = malloc(L ? L : 1);
        if (pread_all(memfd, b, L, 0) < 0)
            abort();
        fz_window w = {b, 0, L};
        rc = fz_read_one_parse(&w, &w, L, &r);
        free(b);
    }
    else {
        unsigned char *hb = malloc(WINDOW), *tb = malloc(WINDOW);
        if (pread_all(memfd, hb, WINDOW, 0) < 0 ||
            pread_all(memfd, tb, WINDOW, L - WINDOW) < 0)
            abort();
        fz_window head = {hb, 0, WINDOW}, tail = {tb, L - WINDOW, WINDOW};
        rc = fz_read_one_parse(&head, &tail, L, &r);
        free(hb);
        free(tb);
    }
    *rec = r.rec;
    return rc;
}

static int roundtrip(const uint8_t *p, size_t n);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= 1 && (data[0] & 4))
        return roundtrip(data + 1, size - 1);
    if (size < 9)
        return 0;
    int flags = data[0];
    uint64_t gap = rd64le(data + 1) & ((1ull << 40) - 1);
    const uint8_t *p = data + 9;
    size_t n = size - 9, h = n / 2;
    uint64_t L = n + gap;

    if (ftruncate(memfd, 0) < 0 || ftruncate(memfd, (off_t)L) < 0 ||
        pwrite(memfd, p, h, 0) != (ssize_t)h ||
        pwrite(memfd, p + h, n - h, (off_t)(L - (n - h))) != (ssize_t)(n - h))
        abort();

    /* the destination */
    static int64_t fallback_shape[1] = {4};
    dcpx_tensor_record rec;
    memset(&rec, 0, sizeof(rec));
    ritem it;
    memset(&it, 0, sizeof(it));
    it.file = 0;
    it.offset = 0;
    it.length = L;
    it.dest.ndim = 1;
    it.dest.shape = fallback_shape;
    it.dest.itemsize = 4;
    it.dest.numel = 4;
    strcpy(it.storage_type, "FloatStorage");
    if (first_pass(L, &rec) == DCPX_PARSE_OK && tensor_can_have(&rec)) {
        uint32_t isz = itemsize_of(rec.storage_type);
        uint64_t numel = 1;
        for (int i = 0; i < rec.ndim; i++)
            numel *= (uint64_t)rec.shape[i]; /* no overflow: checked */
        if (numel <= ((uint64_t)16 << 20) / isz) {
            it.dest.ndim = rec.ndim;
            it.dest.shape = rec.shape;
            it.dest.itemsize = isz;
            it.dest.numel = numel;
            strcpy(it.storage_type, rec.storage_type);
        }
    }
    if (flags & 2)
        strcpy(it.storage_type, "NotAStorage");
    it.dest.nbytes = it.dest.numel * it.dest.itemsize;
    it.dest.contiguous = 1;
    it.dest.device_type = DCPX_DL_CPU;
    it.dest.data = malloc(it.dest.nbytes ? it.dest.nbytes : 1);

    int fds[1] = {memfd};
    rjob job;
    memset(&job, 0, sizeof(job));
    job.items = &it;
    job.n = 1;
    job.fds = fds;
    job.nfiles = 1;
    job.verify = !(flags & 1);
    scratch s;
    s.buf = malloc(WHOLE_MAX > 2 * WINDOW ? WHOLE_MAX : 2 * WINDOW);
    int rc = read_one(&job, &it, &s);
    if ((rc == 0) != (it.code == RD_OK) || it.code < 0 || it.code > RD_CRC)
        __builtin_trap();
    if (memchr(it.msg, 0, sizeof(it.msg)) == NULL)
        __builtin_trap();
    free(s.buf);
    free(it.dest.data);
    return 0;
}

static int roundtrip(const uint8_t *p, size_t n)
{
    if (n < 2)
        return 0;
    const size_t ntypes = sizeof(ITEMSIZE) / sizeof(ITEMSIZE[0]);
    const char *stype = ITEMSIZE[p[0] % ntypes].name;
    uint32_t isz = ITEMSIZE[p[0] % ntypes].itemsize;
    dcpx_tensor_record shape_rec; /* for tensor_can_have() */
    memset(&shape_rec, 0, sizeof(shape_rec));
    shape_rec.ndim = p[1] % 9;
    p += 2;
    n -= 2;
    if (n < 8 * (size_t)shape_rec.ndim)
        return 0;
    for (int i = 0; i < shape_rec.ndim; i++, p += 8, n -= 8)
        shape_rec.shape[i] = (int64_t)(rd64le(p) & (uint64_t)INT64_MAX);
    if (!tensor_can_have(&shape_rec))
        return 0;
    uint64_t numel = 1;
    for (int i = 0; i < shape_rec.ndim; i++)
        numel *= (uint64_t)shape_rec.shape[i];
    if (numel > ((uint64_t)1 << 20) / isz)
        return 0;
    uint64_t nbytes = numel * isz;

    unsigned char *src = malloc(nbytes ? nbytes : 1);
    for (uint64_t k = 0; k < nbytes; k++)
        src[k] = n ? p[k % n] : (unsigned char)k;
    dcpx_archive a;
    if (dcpx_archive_build(&a, stype, shape_rec.shape, shape_rec.ndim, numel,
                           nbytes, 0) != 0)
        abort();
    dcpx_archive_patch_crc(&a, dcpx_crc32(0, src, nbytes));
    uint64_t L = a.head_len + nbytes + a.tail_len;
    if (ftruncate(memfd, 0) < 0 || ftruncate(memfd, (off_t)L) < 0 ||
        pwrite(memfd, a.head, a.head_len, 0) != (ssize_t)a.head_len ||
        (nbytes && pwrite(memfd, src, nbytes, (off_t)a.head_len) != (ssize_t)nbytes) ||
        pwrite(memfd, a.tail, a.tail_len, (off_t)(a.head_len + nbytes)) !=
            (ssize_t)a.tail_len)
        abort();

    ritem it;
    memset(&it, 0, sizeof(it));
    it.length = L;
    it.dest.ndim = shape_rec.ndim;
    it.dest.shape = shape_rec.shape;
    it.dest.itemsize = isz;
    it.dest.numel = numel;
    it.dest.nbytes = nbytes;
    it.dest.contiguous = 1;
    it.dest.device_type = DCPX_DL_CPU;
    it.dest.data = malloc(nbytes ? nbytes : 1);
    strcpy(it.storage_type, stype);
    int fds[1] = {memfd};
    rjob job;
    memset(&job, 0, sizeof(job));
    job.items = &it;
    job.n = 1;
    job.fds = fds;
    job.nfiles = 1;
    job.verify = 1;
    scratch s;
    s.buf = malloc(WHOLE_MAX > 2 * WINDOW ? WHOLE_MAX : 2 * WINDOW);
    int rc = read_one(&job, &it, &s);
    if (rc != 0 || it.code != RD_OK) {
        fprintf(stderr, "round trip failed: %s tensor of rank %d, shape (",
                stype, shape_rec.ndim);
        for (int i = 0; i < shape_rec.ndim; i++)
            fprintf(stderr, "%lld, ", (long long)shape_rec.shape[i]);
        fprintf(stderr, "): code %d: %s\n", it.code, it.msg);
        __builtin_trap();
    }
    if (nbytes && memcmp(it.dest.data, src, nbytes) != 0) {
        fprintf(stderr, "round trip delivered other bytes\n");
        __builtin_trap();
    }
    free(s.buf);
    free(it.dest.data);
    free(src);
    dcpx_archive_free(&a);
    return 0;
}
