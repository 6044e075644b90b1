/* Shared by the libFuzzer targets: the parse steps of csrc/reader.c's
 * read_one and of csrc/module.c's parse_archive, over bytes in memory.
 *
 * These are copies of the *call sequences* (which function is called on
 * which bytes, with which bounds checks in between); the functions called
 * are the real ones from csrc/zipread.c and csrc/crc32.c.  Keep them in step
 * with reader.c / module.c when those change (fuzz_reader.c runs the real
 * read_one, so a drift there is caught by the other target).
 */
#ifndef DCPX_FUZZ_EMULATE_H
#define DCPX_FUZZ_EMULATE_H

#include "../csrc/dcpx.h"

#include <string.h>

/* A window [wbeg, wbeg + wlen) of the archive is in memory at `w`. */
typedef struct {
    const unsigned char *w;
    uint64_t wbeg, wlen;
} fz_window;

/* reader.c's in_window(), verbatim. */
static const unsigned char *fz_in_window(const fz_window *win, uint64_t off,
                                         uint64_t len)
{
    if (off < win->wbeg || off + len > win->wbeg + win->wlen ||
        off + len < off)
        return NULL;
    return win->w + (off - win->wbeg);
}

typedef struct {
    dcpx_tensor_record rec;
    uint64_t pkl_lho, pkl_len, data_lho, data_len, data_at;
    uint32_t pkl_crc, data_crc;
    const char *why;
} fz_result;

/* read_one's parse sequence up to (not including) check_record and the data
 * read.  `head` must start at archive offset 0 and `tail` must end at L, as
 * in read_one (for L <= 256 KiB both are the whole archive).  Touches every
 * byte it is given a pointer to (CRC of data.pkl), so ASan sees overruns. */
static int fz_read_one_parse(const fz_window *head, const fz_window *tail,
                             uint64_t L, fz_result *r)
{
    const char *why = "";
    uint64_t cd_off = 0, cd_len = 0, doff = 0;
    const unsigned char *p = NULL;
    int rc;

    memset(r, 0, sizeof(*r));
    rc = dcpx_zip_find_cd(tail->w, (size_t)tail->wlen, L, &cd_off, &cd_len,
                          &why);
    if (rc == DCPX_PARSE_OK && !(p = fz_in_window(tail, cd_off, cd_len))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "central directory larger than the read window";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_scan_cd(p, (size_t)cd_len, L, &r->pkl_lho, &r->pkl_len,
                              &r->pkl_crc, &r->data_lho, &r->data_len,
                              &r->data_crc, &why);
    if (rc == DCPX_PARSE_OK) { /* reader.c's archive_swaps: the byteorder record */
        uint64_t bo_lho, bo_len, bo_off;
        const unsigned char *b;
        if (dcpx_zip_find_byteorder(p, (size_t)cd_len, &bo_lho, &bo_len) > 0 &&
            (b = fz_in_window(head, bo_lho, 30)) != NULL &&
            dcpx_zip_local_data_off(b, 30, &bo_off, &why) == DCPX_PARSE_OK &&
            (b = fz_in_window(head, bo_lho + bo_off, bo_len)) != NULL && bo_len >= 3)
            (void)memcmp(b, "big", 3);
    }
    if (rc == DCPX_PARSE_OK && !(p = fz_in_window(head, r->pkl_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        !(p = fz_in_window(head, r->pkl_lho + doff, r->pkl_len))) {
        rc = r->pkl_lho + doff + r->pkl_len > L ? DCPX_PARSE_CORRUPT
                                                : DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl lies outside the archive window";
    }
    if (rc == DCPX_PARSE_OK)
        (void)dcpx_crc32(0, p, (size_t)r->pkl_len);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_pickle_parse_tensor(p, (size_t)r->pkl_len, &r->rec, &why);
    if (rc == DCPX_PARSE_OK && !(p = fz_in_window(head, r->data_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data/0 is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        (r->data_lho + doff > L || r->data_len > L - r->data_lho - doff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "tensor data runs past the end of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        r->data_at = r->data_lho + doff;
    r->why = why;
    return rc;
}

/* module.c's parse_archive (the whole archive is in memory), without the
 * Python object building.  Returns the parse code; CRCs the tensor bytes as
 * parse_archive does. */
static int fz_parse_archive(const unsigned char *p, size_t n, fz_result *r)
{
    const char *why = "";
    uint64_t L = n, cd_off = 0, cd_len = 0, poff = 0, doff = 0;
    int rc;

    memset(r, 0, sizeof(*r));
    rc = dcpx_zip_find_cd(p, n, L, &cd_off, &cd_len, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_scan_cd(p + cd_off, (size_t)cd_len, L, &r->pkl_lho,
                              &r->pkl_len, &r->pkl_crc, &r->data_lho,
                              &r->data_len, &r->data_crc, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p + r->pkl_lho, (size_t)(L - r->pkl_lho),
                                     &poff, &why);
    if (rc == DCPX_PARSE_OK &&
        (r->pkl_lho + poff > L || r->pkl_len > L - r->pkl_lho - poff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "data.pkl outside the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_pickle_parse_tensor(p + r->pkl_lho + poff,
                                      (size_t)r->pkl_len, &r->rec, &why);
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p + r->data_lho,
                                     (size_t)(L - r->data_lho), &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        (r->data_lho + doff > L || r->data_len > L - r->data_lho - doff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "data outside the archive";
    }
    if (rc == DCPX_PARSE_OK) {
        r->data_at = r->data_lho + doff;
        (void)dcpx_crc32(0, p + r->data_at, (size_t)r->data_len);
    }
    r->why = why;
    return rc;
}

/* Invariants every successful parse must satisfy (a violation is a bug even
 * without a memory error). */
static void fz_check_record(const dcpx_tensor_record *rec)
{
    if (rec->ndim < 0 || rec->ndim > 16)
        __builtin_trap();
    if (memchr(rec->storage_type, 0, sizeof(rec->storage_type)) == NULL)
        __builtin_trap();
}

#endif
