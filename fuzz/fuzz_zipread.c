/* libFuzzer target for csrc/zipread.c (zip end record, central directory,
 * local headers, the one-tensor pickle) and csrc/crc32.c.
 *
 * Build (fuzz/run.sh does this):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined \
 *         -fno-sanitize-recover=undefined $(python3-config --includes) \
 *         fuzz/fuzz_zipread.c csrc/zipread.c csrc/crc32.c -o fuzz/build/fuzz_zipread
 * dcpx.h includes Python.h for its types only: nothing in zipread.c or
 * crc32.c calls the Python API, so no libpython is linked.
 *
 * The first input byte selects what the rest is (mode = byte & 3):
 *   0, 3  a whole archive: parsed as module.c's parse_archive does, and as
 *         reader.c's read_one does for archives <= 256 KiB (one window).
 *   1     a data.pkl pickle, fed straight to dcpx_pickle_parse_tensor.
 *   2     a large archive seen through read_one's head and tail windows:
 *         bytes 1..8 are a little-endian gap G (masked to 2^44), the rest
 *         R (n bytes) is split at h = n / 2; the archive is
 *         R[0:h] + <G unknown bytes> + R[h:n], of length L = n + G, and the
 *         parser sees only the head window R[0:h] (offset 0) and the tail
 *         window R[h:n] (ending at L), each in its own exact-size heap
 *         block, so a read outside either window is an ASan report.  With
 *         G = 0 it is the one-window form.
 */
#include "emulate.h"

#include <stdlib.h>

static uint64_t rd64le(const uint8_t *p)
{
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = x << 8 | p[i];
    return x;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    dcpx_crc32_init();
    return 0;
}

static void whole(const uint8_t *p, size_t n)
{
    fz_result r;
    fz_window w = {p, 0, n};
    if (fz_parse_archive(p, n, &r) == DCPX_PARSE_OK)
        fz_check_record(&r.rec);
    if (n > 0 && fz_read_one_parse(&w, &w, n, &r) == DCPX_PARSE_OK) {
        fz_check_record(&r.rec);
        /* read_one then memcpy's data_len bytes from the buffer at data_at */
        if (r.data_at + r.data_len > n)
            __builtin_trap();
        (void)dcpx_crc32(0, p + r.data_at, (size_t)r.data_len);
    }
}

static void windowed(const uint8_t *p, size_t n)
{
    if (n < 8)
        return;
    uint64_t gap = rd64le(p) & ((1ull << 44) - 1);
    p += 8;
    n -= 8;
    if (gap == 0) {
        whole(p, n);
        return;
    }
    size_t h = n / 2;
    unsigned char *hw = malloc(h ? h : 1), *tw = malloc(n - h ? n - h : 1);
    if (!hw || !tw)
        abort();
    memcpy(hw, p, h);
    memcpy(tw, p + h, n - h);
    uint64_t L = (uint64_t)n + gap;
    fz_window head = {hw, 0, h}, tail = {tw, L - (n - h), n - h};
    fz_result r;
    if (fz_read_one_parse(&head, &tail, L, &r) == DCPX_PARSE_OK) {
        fz_check_record(&r.rec);
        if (r.data_at + r.data_len > L)
            __builtin_trap();
    }
    free(hw);
    free(tw);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    switch (data[0] & 3) {
    case 1: {
        dcpx_tensor_record rec;
        const char *why = NULL;
        memset(&rec, 0, sizeof(rec));
        if (dcpx_pickle_parse_tensor(p, n, &rec, &why) == DCPX_PARSE_OK)
            fz_check_record(&rec);
        if (why == NULL)
            __builtin_trap(); /* every path sets a reason */
        break;
    }
    case 2:
        windowed(p, n);
        break;
    default:
        whole(p, n);
        break;
    }
    return 0;
}
