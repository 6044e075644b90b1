/* libFuzzer target for csrc/picklescan.c, the opcode scan that
 * dcpx.formats.metadata.loads runs over a .metadata pickle before CPython's
 * unpickler sees it (dcpx._C.check_pickle).  picklescan.c is #included so
 * that its static scan() can be called on the raw input; its Python wrapper
 * makes this target link libpython, which it never calls.
 *
 * Checks beyond ASan/UBSan: an accepted stream ends with its STOP opcode,
 * and the offset reported with a rejection lies inside the input.  (Whether
 * accepted streams are safe for the unpickler is checked one level up, by
 * fuzz/fuzz_metadata.py, which runs loads() itself.)
 */
#include "../csrc/picklescan.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t at = 0;
    const char *why = scan(data, size, &at);
    if (why == NULL && (size == 0 || data[size - 1] != '.'))
        __builtin_trap();
    if (why != NULL && size > 0 && at >= size)
        __builtin_trap();
    return 0;
}
