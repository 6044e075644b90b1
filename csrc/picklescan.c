/* check_pickle: walk a pickle's opcodes before Python's unpickler sees it.
 *
 * The allow-listed Unpickler (dcpx/formats/metadata.py) decides which globals a
 * checkpoint's .metadata may name, but CPython's unpickler trusts the
 * opcode stream itself: a 9-byte pickle whose LONG_BINPUT index is 2**32-1
 * makes it grow its memo table to that size (tens of GiB; found by
 * fuzz/fuzz_metadata.py).  This scan, linear and allocation-free, rejects
 * before any object is built:
 *  - memo indices larger than the pickle (each memo entry needs an opcode);
 *  - arguments or lengths that run past the end of the data;
 *  - opcodes DCP metadata never uses and that reach outside the pickle:
 *    persistent ids, the copyreg extension registry, out-of-band buffers,
 *    and the protocol-0 instance opcodes INST / OBJ;
 *  - unknown opcodes and a missing STOP.
 * Opcode table: Lib/pickletools.py.
 */
#include "dcpx.h"

#include <string.h>

static uint64_t le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Returns NULL if the stream is acceptable, else a reason; *at is the
 * offending opcode's offset. */
static const char *scan(const unsigned char *p, size_t n, size_t *at)
{
    size_t i = 0;
    while (i < n) {
        unsigned char op = p[i];
        size_t arg = 0;      /* fixed argument bytes */
        int lenbytes = 0;    /* length-prefixed: bytes of the length */
        int lines = 0;       /* newline-terminated arguments */
        int memo = 0;        /* the argument is a memo index */
        *at = i++;
        switch (op) {
        case '.':
            return i == n ? NULL : "data after STOP";
        case '(': case '0': case '1': case '2': case 'N': case 'R':
        case 'a': case 'b': case 'd': case '}': case 'e': case 'l':
        case ']': case 's': case 't': case ')': case 'u': case 0x81:
        case 0x85: case 0x86: case 0x87: case 0x88: case 0x89:
        case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 0x94:
            break;
        case 'K': case 0x80: arg = 1; break;
        case 'M': arg = 2; break;
        case 'J': arg = 4; break;
        case 'G': case 0x95: arg = 8; break;
        case 'h': case 'q': arg = 1; memo = 1; break;
        case 'j': case 'r': arg = 4; memo = 1; break;
        case 'U': case 'C': case 0x8c: case 0x8a: lenbytes = 1; break;
        case 'T': case 'X': case 'B': case 0x8b: lenbytes = 4; break;
        case 0x8d: case 0x8e: case 0x96: lenbytes = 8; break;
        case 'F': case 'I': case 'L': case 'S': case 'V': lines = 1; break;
        case 'g': case 'p': lines = 1; memo = 1; break;
        case 'c': lines = 2; break;
        case 'P': case 'Q': return "persistent id in metadata";
        case 0x82: case 0x83: case 0x84: return "copyreg extension code";
        case 0x97: case 0x98: return "out-of-band buffer";
        case 'i': case 'o': return "protocol-0 instance opcode";
        default: return "unknown pickle opcode";
        }
        if (arg) {
            if (n - i < arg)
                return "truncated opcode argument";
            if (memo && le(p + i, (int)arg) > n)
                return "memo index larger than the pickle";
            i += arg;
        }
        if (lenbytes) {
            if (n - i < (size_t)lenbytes)
                return "truncated length";
            uint64_t len = le(p + i, lenbytes);
            i += (size_t)lenbytes;
            if (len > n - i)
                return "length runs past the end of the pickle";
            i += (size_t)len;
        }
        for (int k = 0; k < lines; k++) {
            const unsigned char *nl = memchr(p + i, '\n', n - i);
            if (nl == NULL)
                return "unterminated text argument";
            if (memo) { /* protocol-0 GET/PUT: a decimal index */
                uint64_t v = 0;
                for (const unsigned char *d = p + i; d < nl; d++) {
                    if (*d < '0' || *d > '9' || v > n)
                        return "bad or too large memo index";
                    v = v * 10 + (uint64_t)(*d - '0');
                }
                if (v > n)
                    return "memo index larger than the pickle";
            }
            i = (size_t)(nl - p) + 1;
        }
    }
    return "pickle has no STOP";
}

PyObject *dcpx_check_pickle(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer b;
    const char *why;
    size_t at = 0;
    if (!PyArg_ParseTuple(args, "y*:check_pickle", &b))
        return NULL;
    why = scan(b.buf, (size_t)b.len, &at);
    PyBuffer_Release(&b);
    if (why != NULL) {
        PyErr_Format(PyExc_ValueError, "%s (at byte %zu)", why, at);
        return NULL;
    }
    Py_RETURN_NONE;
}
