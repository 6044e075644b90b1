/* dcpx internal header: the structs shared by the translation units of
 * the dcpx._C extension, and the functions each one exports to the others.
 *
 * Threading rule (see docs/design.md): everything reachable from a
 * dcpx_wjob / dcpx_rjob while its worker threads run is plain C memory.
 * Worker threads never touch a PyObject and never take the GIL.  Python
 * references that keep tensor memory alive are held by the owning Python
 * object (WriteJob / the caller of read_items) and dropped only after the
 * workers have been joined.
 */
#ifndef DCPX_H
#define DCPX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define DCPX_EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ */
/* DLPack (https://dmlc.github.io/dlpack/latest/c_api.html), the subset
 * dcpx consumes.  Field layout must match the spec exactly. */
enum {
    DCPX_DL_CPU = 1,
    DCPX_DL_CUDA = 2,
    DCPX_DL_CUDA_HOST = 3,
    DCPX_DL_CUDA_MANAGED = 13,
};

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#define DCPX_DLPACK_FLAG_READ_ONLY (1ULL << 0)

/* A tensor taken in through DLPack.  `shape`/`strides` point into the
 * producer's DLTensor and stay valid until dcpx_view_release().  The
 * producer's deleter is called exactly once, by dcpx_view_release(). */
typedef struct {
    char *data;              /* first element (DLTensor.data + byte_offset) */
    int ndim;
    const int64_t *shape;
    const int64_t *strides;  /* elements; NULL = compact row-major */
    uint32_t itemsize;       /* bytes per element */
    uint64_t numel;
    uint64_t nbytes;         /* numel * itemsize */
    int device_type;
    int device_id;
    int read_only;
    int contiguous;          /* compact row-major (or numel <= 1) */
    int dtype_code;          /* DLDataType.code */
    /* Ownership: exactly one of these is non-NULL while the view is live. */
    DLManagedTensor *managed;
    DLManagedTensorVersioned *managed_v;
} dcpx_view;

/* dlpack.c */
int dcpx_view_from_object(PyObject *obj, dcpx_view *out, int need_writable);
void dcpx_view_release(dcpx_view *v);
/* Copy the view's elements in row-major order, bytes [from, from+len) of the
 * logical contiguous image, into dst.  Used by workers (no GIL). */
void dcpx_view_gather(const dcpx_view *v, uint64_t from, uint64_t len,
                      char *dst);

/* ------------------------------------------------------------------ */
/* crc32.c: CRC-32 as used by zip (IEEE 802.3, reflected 0xEDB88320). */
uint32_t dcpx_crc32(uint32_t crc, const void *buf, size_t len);
/* Copy src to dst (not overlapping) and return the CRC of the bytes stored
 * in dst, read once from src: a writer that writes dst has a CRC of exactly
 * what it wrote, even if src changes meanwhile. */
uint32_t dcpx_crc32_copy(uint32_t crc, void *dst, const void *src, size_t len);
/* crc of A||B from crc(A), crc(B) and len(B). */
uint32_t dcpx_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
void dcpx_crc32_init(void);
const char *dcpx_crc32_impl(void);

/* ------------------------------------------------------------------ */
/* zipwrite.c: one torch.save-compatible archive holding one tensor. */
#define DCPX_ALIGN 64

/* Room that the head and tail of any archive dcpx builds fit in: the
 * pickle holds at most 2 * 64 dims of <= 10 bytes; the records around it
 * take under 1 KiB. */
#define DCPX_ARCHIVE_MAX 4096

typedef struct {
    char *head;            /* the caller's memory: bytes before the tensor data */
    size_t head_len;
    char *tail;            /* right after head in the same memory */
    size_t tail_len;
    size_t crc_pos_head;   /* where data/0's CRC goes in head */
    size_t crc_pos_tail;   /* where data/0's CRC goes in the central dir */
} dcpx_archive;

/* Build head and tail for a tensor of `shape` (ndim dims) stored
 * contiguously into `mem` (`cap` bytes): head first, tail `tail_skip` bytes
 * after it (room for the tensor bytes: the archive is then contiguous in
 * `mem`; 0 puts the tail right after the head, and DCPX_ARCHIVE_MAX always
 * suffices then).  Nothing is allocated, so writer threads build each
 * archive where it is written.  With mem == NULL nothing is written: only
 * a->head_len and a->tail_len are set (the lengths that fix the layout).  `storage_type` is the pickle
 * global name torch uses ("FloatStorage", "uint16", ...); `serial` is the
 * archive's serialization id.  data/0's CRC is left 0 until
 * dcpx_archive_patch_crc.  Returns 0, or -1 with errno ERANGE (cap too
 * small). */
int dcpx_archive_build(dcpx_archive *a, char *mem, size_t cap, size_t tail_skip,
                       const char *storage_type, const int64_t *shape, int ndim,
                       uint64_t numel, uint64_t nbytes, uint64_t serial);
void dcpx_archive_patch_crc(dcpx_archive *a, uint32_t crc);

/* ------------------------------------------------------------------ */
/* zipread.c: validate an archive and find the tensor's bytes. */
typedef struct {
    uint64_t data_off;     /* of data/0, relative to the archive start */
    uint64_t data_len;
    uint32_t data_crc;
    int has_crc;           /* the archive recorded a non-zero CRC */
    /* From data.pkl: */
    char storage_type[48];
    uint64_t storage_numel;  /* elements, or bytes if numel_in_bytes */
    int numel_in_bytes;      /* UntypedStorage (_rebuild_tensor_v3) */
    uint64_t storage_offset; /* elements */
    int ndim;
    int64_t shape[16];
    int64_t stride[16];
} dcpx_tensor_record;

enum {
    DCPX_PARSE_OK = 0,
    DCPX_PARSE_NEED_MORE = 1, /* the central directory lies outside `tail` */
    DCPX_PARSE_UNSUPPORTED = 2, /* valid, but not the simple one-storage form */
    DCPX_PARSE_CORRUPT = 3,
};

/* Parse the end of an archive of `archive_len` bytes.  `tail` holds its last
 * `tail_len` bytes.  On DCPX_PARSE_OK fills `*cd_off`/`*cd_len` (central
 * directory, relative to archive start). */
int dcpx_zip_find_cd(const unsigned char *tail, size_t tail_len,
                     uint64_t archive_len, uint64_t *cd_off, uint64_t *cd_len,
                     const char **why);
/* Walk the central directory; locate data.pkl and data/0.  Offsets are of the
 * local headers, relative to archive start. */
int dcpx_zip_scan_cd(const unsigned char *cd, size_t cd_len,
                     uint64_t archive_len, uint64_t *pkl_lho,
                     uint64_t *pkl_len, uint32_t *pkl_crc, uint64_t *data_lho,
                     uint64_t *data_len, uint32_t *data_crc, const char **why);
/* Locate the archive's byteorder record in its central directory: 1
 * (found), 0 (none: little-endian, as torch assumes), -1 (needs zip64). */
int dcpx_zip_find_byteorder(const unsigned char *cd, size_t cd_len,
                            uint64_t *lho, uint64_t *len);
/* Given the bytes at a local header (at least 30 + name + extra), return the
 * offset of its data relative to the header.  */
int dcpx_zip_local_data_off(const unsigned char *lh, size_t avail,
                            uint64_t *data_off, const char **why);
/* Parse torch's one-tensor data.pkl. */
int dcpx_pickle_parse_tensor(const unsigned char *p, size_t n,
                             dcpx_tensor_record *rec, const char **why);

/* ------------------------------------------------------------------ */
/* reader.c: one archive of a read, and the steps of reading it that the
 * CUDA load pipeline (cuda_pipe.c) shares with read_items. */
enum {
    DCPX_RD_OK = 0,
    DCPX_RD_FALLBACK = 1, /* valid, in a form left to torch.load */
    DCPX_RD_CORRUPT = 2,
    DCPX_RD_IO = 3,
    DCPX_RD_CRC = 4,
};
#define DCPX_READ_WINDOW ((size_t)64 << 10) /* head and tail windows */

typedef struct {
    Py_ssize_t file;
    uint64_t offset, length;
    /* What the archive must hold: its shape, itemsize and byte count are
     * checked against the record (read_items: the destination itself,
     * owned and released after the join; the pipeline: a description of
     * the saved chunk, owning nothing). */
    dcpx_view dest;
    char storage_type[48];   /* "": the extent holds the raw bytes */
    /* result */
    int code;
    int err;
    char msg[160];
} dcpx_ritem;

/* Where an archive's tensor bytes lie, relative to the archive's start. */
typedef struct {
    uint64_t at, len;
    uint32_t crc;      /* recorded; 0: none */
    uint32_t swap;     /* bytes of each swapped unit (other byte order); 0 */
    int in_mem;        /* the whole archive was in memory (mem or scratch) */
} dcpx_archive_loc;

/* pread exactly n bytes; -1 with errno (0: the file is short). */
int dcpx_pread_all(int fd, void *p, size_t n, uint64_t off);
/* Record a failure in it; returns -1. */
int dcpx_ritem_fail(dcpx_ritem *it, int code, int err, const char *msg);
int dcpx_ritem_io_fail(dcpx_ritem *it, const char *what);
/* Parse the archive it names (from mem when its bytes are there, else from
 * fd: whole into scratch when it is at most 2 * DCPX_READ_WINDOW, else its
 * head and tail windows; scratch holds 2 * DCPX_READ_WINDOW), check
 * data.pkl's CRC (verify) and the record against it->dest, and locate the
 * tensor bytes.  0, or -1 with the failure in it. */
int dcpx_archive_locate(int fd, int verify, dcpx_ritem *it,
                        unsigned char *scratch, const unsigned char *mem,
                        dcpx_archive_loc *loc);
/* 0 when crc matches the recorded one (or none was recorded), else -1
 * with a CRC failure in it. */
int dcpx_archive_check_crc(dcpx_ritem *it, uint32_t recorded, uint32_t crc);
/* Reverse each `unit`-byte element of p[0 .. n) in place. */
void dcpx_byteswap(unsigned char *p, uint64_t n, uint32_t unit);

/* ------------------------------------------------------------------ */
/* Types (writer.c, reader.c) and module plumbing (module.c). */
/* flatten.c: what the state dict walk compares against, imported on
 * first use; all owned. */
typedef struct {
    PyObject *mapping;   /* collections.abc.Mapping */
    PyObject *tensor;    /* torch.Tensor */
    PyObject *parameter; /* torch.nn.Parameter */
    PyObject *token_fn;  /* abc.get_cache_token */
    PyObject *token;     /* its value when `trusted` was computed */
    int trusted;         /* the exact types' isinstance() answers hold */
} dcpx_flatten_types;

typedef struct {
    PyTypeObject *WriteJob_Type;
    PyObject *CudaError; /* dcpx._C.CudaError (csrc/cuda.c) */
    dcpx_flatten_types flat;
} dcpx_state;

PyObject *dcpx_flatten_state_dict(PyObject *module, PyObject *state_dict);
int dcpx_flatten_traverse(dcpx_flatten_types *t, visitproc visit, void *arg);
void dcpx_flatten_clear(dcpx_flatten_types *t);

extern PyType_Spec dcpx_writejob_spec;
PyObject *dcpx_read_items(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_read_plan(PyObject *module, PyObject *args);
PyObject *dcpx_read_plan_run(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_probe_tensor(PyObject *module, PyObject *obj);
PyObject *dcpx_copy_into(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_prefault(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_stage_plain(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_check_pickle(PyObject *module, PyObject *args);

/* mdindex.c: a .metadata pickle decoded into a load's tables (see there). */
#define DCPX_MDINDEX_NAME "dcpx.md_index"
enum { DCPX_MD_TENSOR = 1, DCPX_MD_BYTES = 2 };
typedef struct dcpx_mdindex dcpx_mdindex;
typedef struct {
    int ndim;
    const int64_t *size;
    int whole;                /* saved as one chunk: the whole tensor */
    Py_ssize_t file;          /* that chunk's storage entry */
    uint64_t offset, length;
    PyObject *dtype;          /* borrowed torch.dtype */
    const char *storage_type; /* NULL: not read in place */
    Py_ssize_t entry;         /* that chunk's storage entry's index */
    Py_ssize_t pos;           /* for the caller */
} dcpx_md_tensor;
PyObject *dcpx_md_index(PyObject *module, PyObject *args);
PyObject *dcpx_md_index_check(PyObject *module, PyObject *args);
PyObject *dcpx_md_index_bytes(PyObject *module, PyObject *args);
PyObject *dcpx_md_index_entries(PyObject *module, PyObject *index);
PyObject *dcpx_md_index_len(PyObject *module, PyObject *index);
PyObject *dcpx_md_index_region(PyObject *module, PyObject *args);
PyObject *dcpx_read_plan_md(PyObject *module, PyObject *args, PyObject *kwds);
const dcpx_mdindex *dcpx_mdindex_get(PyObject *cap);
/* 0: no such key; DCPX_MD_BYTES; DCPX_MD_TENSOR with *out filled.
 * *cursor (start at 0): where the next key is looked for first. */
int dcpx_mdindex_find(const dcpx_mdindex *ix, const char *key, Py_ssize_t len,
                      Py_ssize_t *cursor, dcpx_md_tensor *out);
Py_ssize_t dcpx_mdindex_nfiles(const dcpx_mdindex *ix);
Py_ssize_t dcpx_mdindex_nstorage(const dcpx_mdindex *ix);
PyObject *dcpx_dump_metadata(PyObject *module, PyObject *args, PyObject *kwds);
PyObject *dcpx_scan_plain(PyObject *module, PyObject *args);
PyObject *dcpx_dlpack_dtype_key(PyObject *module, PyObject *cap);

/* Run fn(arg) on nthreads threads (at most 64): nthreads - 1 new ones plus
 * the caller's, then join.  Workers share a counter in `arg`, so if a
 * pthread_create fails the caller's thread still drains all the work.
 * Called with the GIL released. */
void dcpx_run_workers(void *(*fn)(void *), void *arg, int nthreads);

/* Checkpoint files (files.c).  dcpx_open_regular: open for reading without
 * following a link or blocking on a FIFO; only a regular file is returned.
 * On failure -1 with errno set, and *why set to a static description when
 * the path exists but is a link, FIFO, directory, ... (else NULL).
 * dcpx_create_fresh: remove whatever has the name, then create it with
 * O_EXCL (never through a link); -1 with errno on failure. */
int dcpx_open_regular(const char *path, const char **why);
int dcpx_create_fresh(const char *path);

/* Turn (errno, what, path) into an OSError naming the file. */
void dcpx_set_oserror(int err, const char *what, const char *path);

#endif /* DCPX_H */
