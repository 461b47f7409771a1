/*
 * Change detection for the patch codec: one pass over two equal-size buffers of raw element
 * bits, emitting the gap-coded positions of the elements whose bits differ and, per changed
 * element, either the XOR of old and new bits or the new bits.
 *
 * This is the hot loop of encoding (the rest is numpy and zstd): it compares 8 bytes at a time
 * and only looks at single elements inside words that differ, and it runs without the GIL so
 * the Python side can split a tensor between threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "stitchboard's bitdiff kernel assumes a little-endian machine"
#endif

typedef struct {
    char *data;
    size_t len, cap;
} growbuf;

static int gb_reserve(growbuf *g, size_t extra) {
    if (g->len + extra <= g->cap) return 0;
    size_t cap = g->cap ? g->cap : 1 << 16;
    while (cap < g->len + extra) cap *= 2;
    char *p = realloc(g->data, cap);
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

/* Append one changed element: its gap from *prev and its value (old ^ new, or new). */
static inline int emit_one(growbuf *gaps, growbuf *vals, int gap_width, size_t itemsize, int use_xor,
                           Py_ssize_t idx, int64_t *prev, uint64_t old, uint64_t new_) {
    if (gaps->len + 8 > gaps->cap || vals->len + 8 > vals->cap) {
        if (gb_reserve(gaps, 8) || gb_reserve(vals, 8)) return -1;
    }
    const uint64_t gap = (uint64_t)((int64_t)idx - *prev - 1);
    memcpy(gaps->data + gaps->len, &gap, (size_t)gap_width); /* little-endian: low bytes first */
    gaps->len += (size_t)gap_width;
    const uint64_t v = use_xor ? (old ^ new_) : new_;
    memcpy(vals->data + vals->len, &v, itemsize);
    vals->len += itemsize;
    *prev = (int64_t)idx;
    return 0;
}

/*
 * Scan elements [start, stop) of two buffers of T, appending gaps (gap_width bytes each) and
 * values (XOR or new bits) to the growable buffers. Aligned 8-byte words that are equal are
 * skipped with one compare; in a differing word a lane mask (the top bit of each element set
 * iff that element differs) is walked with count-trailing-zeros, so the cost is per changed
 * element, not per element. Returns 0, or -1 when out of memory. *prev_io is the index of the
 * last changed element.
 */
#define DEFINE_SCAN(NAME, T)                                                                          \
    static int NAME(const T *a, const T *b, Py_ssize_t start, Py_ssize_t stop, int gap_width,         \
                    int use_xor, growbuf *gaps, growbuf *vals, int64_t *prev_io) {                    \
        const Py_ssize_t per_word = 8 / (Py_ssize_t)sizeof(T);                                        \
        const unsigned lane_bits = 8u * (unsigned)sizeof(T);                                          \
        const uint64_t high = lane_high_bits(lane_bits), low = ~high;                                 \
        int64_t prev = *prev_io;                                                                      \
        Py_ssize_t i = start;                                                                         \
        /* elements before the first aligned word, and after the last, go one by one */               \
        Py_ssize_t head_end = i;                                                                      \
        while (head_end < stop && (((uintptr_t)(a + head_end)) & 7) != 0) head_end++;                 \
        for (; i < head_end; i++) {                                                                   \
            if (a[i] != b[i] && emit_one(gaps, vals, gap_width, sizeof(T), use_xor, i, &prev,         \
                                         (uint64_t)a[i], (uint64_t)b[i])) return -1;                  \
        }                                                                                             \
        for (; i + per_word <= stop; i += per_word) {                                                 \
            uint64_t wa, wb;                                                                          \
            memcpy(&wa, a + i, 8);                                                                    \
            memcpy(&wb, b + i, 8);                                                                    \
            const uint64_t x = wa ^ wb;                                                               \
            if (x == 0) continue;                                                                     \
            const uint64_t m = (((x & low) + low) | x) & high;                                        \
            if (gaps->len + 8 * (size_t)per_word > gaps->cap || vals->len + 8 * (size_t)per_word > vals->cap) { \
                if (gb_reserve(gaps, 8 * (size_t)per_word) || gb_reserve(vals, 8 * (size_t)per_word)) return -1; \
            }                                                                                         \
            /* branch-free: write every lane's entry, advance only past the changed ones */           \
            unsigned char *gp = (unsigned char *)gaps->data + gaps->len;                              \
            T *vp = (T *)(vals->data + vals->len);                                                    \
            size_t emitted = 0;                                                                       \
            for (Py_ssize_t k = 0; k < per_word; k++) {                                               \
                const Py_ssize_t j = i + k;                                                           \
                const size_t flag = (size_t)((m >> ((unsigned)k * lane_bits + lane_bits - 1)) & 1u);   \
                const uint64_t gap = (uint64_t)((int64_t)j - prev - 1);                               \
                memcpy(gp, &gap, 8);                                                                  \
                vp[emitted] = use_xor ? (T)(a[j] ^ b[j]) : b[j];                                      \
                gp += flag * (size_t)gap_width;                                                       \
                emitted += flag;                                                                      \
                prev = flag ? (int64_t)j : prev;                                                      \
            }                                                                                         \
            gaps->len += emitted * (size_t)gap_width;                                                 \
            vals->len += emitted * sizeof(T);                                                         \
        }                                                                                             \
        for (; i < stop; i++) {                                                                       \
            if (a[i] != b[i] && emit_one(gaps, vals, gap_width, sizeof(T), use_xor, i, &prev,         \
                                         (uint64_t)a[i], (uint64_t)b[i])) return -1;                  \
        }                                                                                             \
        *prev_io = prev;                                                                              \
        return 0;                                                                                     \
    }

DEFINE_SCAN(scan8, uint8_t)
DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

/*
 * diff(old, new, itemsize, gap_width, use_xor, start, stop, prev)
 *   old, new: contiguous buffers of equal length (raw element bits, little-endian), aligned to
 *             their element size
 *   itemsize: element size in bytes (1, 2, 4 or 8); gap_width: 4 or 8 bytes per gap
 *   start, stop: element range to scan; prev: index of the previous changed element (-1: none)
 * Returns (count, gaps: bytes, values: bytes, last_index).
 * gap_i = index_i - index_{i-1} - 1, with index_{-1} = prev. Gaps are little-endian unsigned
 * gap_width-byte integers; values are itemsize-byte elements (old XOR new, or new).
 */
static PyObject *bitdiff_diff(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t itemsize, start, stop;
    int gap_width, use_xor;
    long long prev_in;
    if (!PyArg_ParseTuple(args, "y*y*niinnL", &a, &b, &itemsize, &gap_width, &use_xor, &start, &stop, &prev_in))
        return NULL;
    PyObject *result = NULL;
    if (a.len != b.len || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) ||
        (gap_width != 4 && gap_width != 8) || start < 0 || stop < start || stop * itemsize > a.len ||
        ((uintptr_t)a.buf | (uintptr_t)b.buf) % (uintptr_t)itemsize != 0) {
        PyErr_SetString(PyExc_ValueError, "bitdiff.diff: bad buffer sizes, alignment or arguments");
        PyBuffer_Release(&a);
        PyBuffer_Release(&b);
        return NULL;
    }
    growbuf gaps = {0}, vals = {0};
    int64_t prev = (int64_t)prev_in;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1: failed = scan8(a.buf, b.buf, start, stop, gap_width, use_xor, &gaps, &vals, &prev); break;
    case 2: failed = scan16(a.buf, b.buf, start, stop, gap_width, use_xor, &gaps, &vals, &prev); break;
    case 4: failed = scan32(a.buf, b.buf, start, stop, gap_width, use_xor, &gaps, &vals, &prev); break;
    default: failed = scan64(a.buf, b.buf, start, stop, gap_width, use_xor, &gaps, &vals, &prev); break;
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
    } else {
        Py_ssize_t count = (Py_ssize_t)(vals.len / (size_t)itemsize);
        result = Py_BuildValue("ny#y#L", count, gaps.data ? gaps.data : "", (Py_ssize_t)gaps.len,
                               vals.data ? vals.data : "", (Py_ssize_t)vals.len, (long long)prev);
    }
    free(gaps.data);
    free(vals.data);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

static PyMethodDef methods[] = {
    {"diff", bitdiff_diff, METH_VARARGS, "diff(old, new, itemsize, gap_width, use_xor, start, stop, prev) -> (count, gaps, values, last)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bitdiff", "Bitwise change detection for the patch codec.", -1, methods};

PyMODINIT_FUNC PyInit__bitdiff(void) { return PyModule_Create(&module); }
