/*
 * The two hot loops of the patch codec, run without the GIL:
 *
 * diff(old, new, itemsize, use_xor) scans two equal-size buffers of raw element bits and
 * returns the changed elements' positions as LEB128 varint gaps (gap_i = pos_i - pos_{i-1} - 1,
 * pos_{-1} = -1) and their values (old XOR new, or new). Equal aligned 8-byte words are skipped
 * with one compare; inside a differing word a lane mask (top bit of each element set iff the
 * element differs) is walked with count-trailing-zeros, so the cost is per changed element.
 *
 * positions(gaps, count, numel) decodes and validates a varint gap stream into int64
 * positions: exactly `count` varints that use every byte, none longer than 10 bytes, and every
 * position < numel (so positions are strictly increasing and in range by construction).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_varint.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "stitchboard's bitdiff kernel assumes a little-endian machine"
#endif

typedef struct {
    unsigned char *data;
    size_t len, cap;
} growbuf;

static int gb_reserve(growbuf *g, size_t extra) {
    if (g->len + extra <= g->cap) return 0;
    size_t cap = g->cap ? g->cap : 1 << 16;
    while (cap < g->len + extra) cap *= 2;
    unsigned char *p = realloc(g->data, cap);
    if (!p) return -1;
    g->data = p;
    g->cap = cap;
    return 0;
}

/* 64-bit word with the top bit of every lane of lane_bits bits set. */
static inline uint64_t lane_high_bits(unsigned lane_bits) {
    uint64_t h = 0;
    for (unsigned s = lane_bits - 1; s < 64; s += lane_bits) h |= (uint64_t)1 << s;
    return h;
}

/*
 * Make room for at least one more element (10 gap bytes, 8 value bytes): store the cursors'
 * lengths in the buffers, grow them, and reload the cursors. Returns 0, or -1 when out of memory.
 */
static int make_room(growbuf *gaps, growbuf *vals, unsigned char **g, unsigned char **gend, unsigned char **v, unsigned char **vend) {
    gaps->len = (size_t)(*g - gaps->data);
    vals->len = (size_t)(*v - vals->data);
    if (gb_reserve(gaps, 10) || gb_reserve(vals, 8)) return -1;
    *g = gaps->data + gaps->len;
    *gend = gaps->data + gaps->cap;
    *v = vals->data + vals->len;
    *vend = vals->data + vals->cap;
    return 0;
}

/*
 * Append changed element j (value bits OLD_, NEW_) to the local cursors g (varint gaps, put_gap) and v
 * (values). The cursors are plain locals whose address is taken only on the rare grow path, so
 * the compiler keeps them in registers across the byte stores.
 */
#define EMIT(J, OLD_, NEW_)                                                                       \
    do {                                                                                          \
        if ((gend - g < 10 || vend - v < 8) && make_room(gaps, vals, &g, &gend, &v, &vend)) return -1; \
        g = put_gap(g, (uint64_t)((int64_t)(J) - prev - 1));                                      \
        const __typeof__(*a) val_ = use_xor ? (__typeof__(*a))((OLD_) ^ (NEW_)) : (NEW_);         \
        memcpy(v, &val_, sizeof val_);                                                           \
        v += sizeof val_;                                                                         \
        prev = (int64_t)(J);                                                                      \
    } while (0)

#define DEFINE_SCAN(NAME, T)                                                                          \
    static int NAME(const T *a, const T *b, Py_ssize_t n, int use_xor, growbuf *gaps, growbuf *vals) { \
        const Py_ssize_t per_word = 8 / (Py_ssize_t)sizeof(T);                                        \
        const unsigned lane_bits = 8u * (unsigned)sizeof(T);                                          \
        const uint64_t high = lane_high_bits(lane_bits), low = ~high;                                 \
        unsigned char *g = gaps->data + gaps->len, *gend = gaps->data + gaps->cap;                    \
        unsigned char *v = vals->data + vals->len, *vend = vals->data + vals->cap;                    \
        int64_t prev = -1;                                                                            \
        Py_ssize_t i = 0;                                                                             \
        /* elements before the first 8-byte aligned word, and after the last, go one by one */       \
        for (; i < n && (((uintptr_t)(a + i)) & 7) != 0; i++) {                                       \
            if (a[i] != b[i]) EMIT(i, a[i], b[i]);                                                    \
        }                                                                                             \
        for (; i + per_word <= n; i += per_word) {                                                    \
            uint64_t wa, wb;                                                                          \
            memcpy(&wa, a + i, 8);                                                                    \
            memcpy(&wb, b + i, 8);                                                                    \
            const uint64_t x = wa ^ wb;                                                               \
            if (__builtin_expect(x == 0, 1)) continue;                                                \
            uint64_t m = (((x & low) + low) | x) & high;                                              \
            while (m) {                                                                               \
                const Py_ssize_t j = i + (Py_ssize_t)((unsigned)__builtin_ctzll(m) / lane_bits);      \
                EMIT(j, a[j], b[j]);                                                                  \
                m &= m - 1;                                                                           \
            }                                                                                         \
        }                                                                                             \
        for (; i < n; i++) {                                                                          \
            if (a[i] != b[i]) EMIT(i, a[i], b[i]);                                                    \
        }                                                                                             \
        gaps->len = (size_t)(g - gaps->data);                                                         \
        vals->len = (size_t)(v - vals->data);                                                         \
        return 0;                                                                                     \
    }

DEFINE_SCAN(scan8, uint8_t)
DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

/*
 * diff(old, new, itemsize, use_xor) -> (count, gaps: bytes, values: bytes)
 *   old, new: contiguous buffers of equal length, aligned to their element size
 *   itemsize: element size in bytes (1, 2, 4 or 8); use_xor: values are old^new, else new
 */
static PyObject *bitdiff_diff(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t itemsize;
    int use_xor;
    if (!PyArg_ParseTuple(args, "y*y*np", &a, &b, &itemsize, &use_xor)) return NULL;
    if (a.len != b.len || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) || a.len % itemsize != 0 ||
        ((uintptr_t)a.buf | (uintptr_t)b.buf) % (uintptr_t)itemsize != 0) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "bitdiff.diff: buffers must have equal size, a multiple of itemsize, aligned to it");
        return NULL;
    }
    growbuf gaps = {0}, vals = {0};
    const Py_ssize_t n = a.len / itemsize;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: failed = scan8(a.buf, b.buf, n, use_xor, &gaps, &vals); break;
    case 2: failed = scan16(a.buf, b.buf, n, use_xor, &gaps, &vals); break;
    case 4: failed = scan32(a.buf, b.buf, n, use_xor, &gaps, &vals); break;
    default: failed = scan64(a.buf, b.buf, n, use_xor, &gaps, &vals); break;
    }
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (failed) {
        PyErr_NoMemory();
    } else {
        result = Py_BuildValue("ny#y#", (Py_ssize_t)(vals.len / (size_t)itemsize), gaps.data ? (char *)gaps.data : "",
                               (Py_ssize_t)gaps.len, vals.data ? (char *)vals.data : "", (Py_ssize_t)vals.len);
    }
    free(gaps.data);
    free(vals.data);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

/*
 * positions(gaps, out, numel) -> None
 *   gaps: LEB128 varint stream; out: writable int64 buffer of `count` elements; numel: bound
 * Raises ValueError naming the problem: a truncated, overlong or leftover varint, fewer or more
 * varints than `count`, or a position >= numel.
 */
static PyObject *bitdiff_positions(PyObject *self, PyObject *args) {
    Py_buffer g, out;
    long long numel;
    if (!PyArg_ParseTuple(args, "y*w*L", &g, &out, &numel)) return NULL;
    const char *err = NULL;
    if (out.len % 8 != 0 || ((uintptr_t)out.buf) % 8 != 0) {
        err = "output buffer must be aligned int64";
    } else {
        const Py_ssize_t count = out.len / 8;
        const unsigned char *p = g.buf, *end = p + g.len;
        int64_t *pos = out.buf;
        int64_t prev = -1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < count && !err; k++) {
            uint64_t v = 0;
            unsigned shift = 0;
            for (;;) {
                if (p == end) { err = "gap stream is truncated (fewer varints than the count)"; break; }
                const unsigned char byte = *p++;
                if (shift == 63 && byte > 1) { err = "a gap varint overflows 64 bits"; break; }
                v |= (uint64_t)(byte & 0x7F) << shift;
                if (!(byte & 0x80)) break;
                shift += 7;
                if (shift > 63) { err = "a gap varint is longer than 10 bytes"; break; }
            }
            if (err) break;
            if (v >= (uint64_t)(numel - 1 - prev)) { err = "a position is out of range or unsorted (gap runs past the tensor)"; break; }
            prev = prev + 1 + (int64_t)v;
            pos[k] = prev;
        }
        if (!err && p != end) err = "gap stream has bytes left after the last varint";
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&g);
    PyBuffer_Release(&out);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"diff", bitdiff_diff, METH_VARARGS, "diff(old, new, itemsize, use_xor) -> (count, varint gaps, values)"},
    {"positions", bitdiff_positions, METH_VARARGS, "positions(gaps, out_int64, numel): decode and validate varint gaps"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bitdiff", "Bitwise change detection and gap decoding for the patch codec.", -1, methods};

PyMODINIT_FUNC PyInit__bitdiff(void) { return PyModule_Create(&module); }
