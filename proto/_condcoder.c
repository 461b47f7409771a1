/*
 * The `cond` patch encoding's C extension (byte format: proto/cond_codec.py):
 *
 * encode(base, target, itemsize, class_shift, class_bits, sign_magnitude[, loops[, with_change]])
 *     -> (count, stream[, gaps, values]: the change record, as _bitdiff.diff gives it)
 * decode(base, stream, positions_out, values_out, itemsize, class_shift, class_bits, sign_magnitude[, loops])
 *
 * Both run without the GIL. Every element's class is a bit field of its base bits (the exponent
 * of a float). Changed positions are coded as gaps within their class's subsequence, values as
 * the signed step between base and target in the monotone integer order of the bit patterns,
 * with the range coder of _rangecoder.h and the context model of _condmodel.h. This file holds
 * the value coding, the per-dtype loops over the elements and the Python entry points; the same
 * loops counting classes 64 elements at a time are in _condblocks.h (used where the host has
 * them, `blocks`, with AVX2 where it has that too, `avx2`; `loops` 1 asks for these loops
 * instead, 2 for the SSE2 blocks: same streams, same results).
 *
 * decode validates while it decodes: the class counts must add up to `count`, every gap must
 * land inside its class and the stream must end exactly after its last change; any violation
 * raises ValueError before the caller writes anything. Work is linear in numel + stream length
 * for any input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "stitchboard's cond coder assumes a little-endian machine"
#endif

#include "_rangecoder.h"
#include "_condmodel.h"
#include "_varint.h"

#define END UINT64_MAX /* "no further change in this class" */

/* ---- values: the signed step d (mod 2^width, d != 0) in the monotone order of the bit patterns ---- */
static inline uint64_t order_key(uint64_t bits, unsigned width, int sign_magnitude) {
    if (!sign_magnitude) return bits;
    const uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    const uint64_t sign = (uint64_t)1 << (width - 1);
    return (bits & sign) ? (~bits & mask) : (bits | sign);
}

static inline uint64_t from_key(uint64_t key, unsigned width, int sign_magnitude) {
    if (!sign_magnitude) return key;
    const uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    const uint64_t sign = (uint64_t)1 << (width - 1);
    return (key & sign) ? (key ^ sign) : (~key & mask);
}

static void enc_value(enc_t *e, model_t *m, unsigned v, uint64_t old, uint64_t new_, unsigned width, int sm) {
    const uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    const uint64_t half = (uint64_t)1 << (width - 1);
    const uint64_t step = (order_key(new_, width, sm) - order_key(old, width, sm)) & mask;
    const unsigned negative = step > half;
    const uint64_t mag = negative ? ((0 - step) & mask) : step; /* 1 .. 2^(width-1) */
    const unsigned bucket = bit_length(mag);                    /* 1 .. width */
    val_model_t *vm = val_of(m, v);
    enc_bit(e, &vm->sign, negative);
    for (unsigned i = 1; i < width; i++) {
        enc_bit(e, &vm->unary[negative][i], bucket > i);
        if (bucket == i) break;
    }
    if (bucket < 2) return;
    bit_t *blk = mag_of(m, v, negative, bucket);
    const unsigned in_tree = bucket - 1 < TREE_BITS ? bucket - 1 : TREE_BITS;
    unsigned node = 1;
    for (unsigned j = 0; j + 1 < bucket; j++) {
        const unsigned b = (unsigned)(mag >> (bucket - 2 - j)) & 1;
        if (j < in_tree) {
            enc_bit(e, &blk[node], b);
            node = 2 * node + b;
        } else if (j < in_tree + POS_BITS) {
            enc_bit(e, &blk[(1u << in_tree) + j - in_tree], b);
        } else {
            enc_direct(e, b, 1);
        }
    }
}

static uint64_t dec_value(dec_t *d, model_t *m, unsigned v, uint64_t old, unsigned width, int sm, const char **err) {
    const uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    const uint64_t half = (uint64_t)1 << (width - 1);
    val_model_t *vm = val_of(m, v);
    const unsigned negative = dec_bit(d, &vm->sign);
    unsigned bucket = 1;
    while (bucket < width && dec_bit(d, &vm->unary[negative][bucket])) bucket++;
    uint64_t mag = 1;
    if (bucket >= 2) {
        bit_t *blk = mag_of(m, v, negative, bucket);
        const unsigned in_tree = bucket - 1 < TREE_BITS ? bucket - 1 : TREE_BITS;
        unsigned node = 1;
        for (unsigned j = 0; j + 1 < bucket; j++) {
            unsigned b;
            if (j < in_tree) {
                b = dec_bit(d, &blk[node]);
                node = 2 * node + b;
            } else if (j < in_tree + POS_BITS) {
                b = dec_bit(d, &blk[(1u << in_tree) + j - in_tree]);
            } else {
                b = (unsigned)dec_direct(d, 1);
            }
            mag = (mag << 1) | b;
        }
    }
    if (mag > half || (negative && mag == half)) *err = "a step is larger than half the value range";
    const uint64_t step = negative ? ((0 - mag) & mask) : mag;
    return from_key((order_key(old, width, sm) + step) & mask, width, sm);
}

typedef struct {
    unsigned itemsize, width, shift, sm;
    uint64_t cmask;
    unsigned kernel;
} layout_t;

static inline unsigned cls(const layout_t *L, uint64_t bits) { return (unsigned)((bits >> L->shift) & L->cmask); }
static inline unsigned vctx(const layout_t *L, uint64_t bits) { return 2 * cls(L, bits) + (unsigned)(bits >> (L->width - 1)); }

/* Grow the arrays (doubling); returns -1 when out of memory. */
static int reserve(changes_t *ch) {
    const size_t cap = ch->cap ? 2 * ch->cap : 4096;
    uint64_t *r = realloc(ch->rank, cap * sizeof(uint64_t));
    if (r) ch->rank = r;
    uint64_t *o = realloc(ch->old, cap * sizeof(uint64_t));
    if (o) ch->old = o;
    uint64_t *w = realloc(ch->new_, cap * sizeof(uint64_t));
    if (w) ch->new_ = w;
    uint64_t *p = realloc(ch->pos, cap * sizeof(uint64_t));
    if (p) ch->pos = p;
    if (!r || !o || !w || !p) return -1;
    ch->cap = cap;
    return 0;
}

/* The walk's step at element I (bits OLD, class C): a change when its rank is the class's next. */
#define WALK_ONE(I, OLD, C)                                                                                        \
    do {                                                                                                           \
        const unsigned c_ = (C);                                                                                   \
        const uint64_t r_ = seen[c_]++;                                                                            \
        if (__builtin_expect(r_ == next[c_], 0)) {                                                                 \
            pos[k] = (I);                                                                                          \
            vals[k] = (__typeof__(vals[0]))dec_value(d, m, 2 * c_ + (unsigned)((OLD) >> (W - 1)), (OLD), W, sm, err); \
            if (++k == count || *err) return k;                                                                    \
            next[c_] = --left[c_] ? r_ + 1 + dec_number(d, m->gap[c_].unary, m->gap[c_].mant) : END;               \
        }                                                                                                          \
    } while (0)

/*
 * Per element type T: scan (the encoder: every changed element and its rank in its class) and
 * walk (the decoder: find each change by its rank, decode its value, then its class's next
 * gap). Both read 8-byte words of PER elements. The scan counts ranks in PER interleaved
 * tables (consecutive elements of one class then do not wait on each other's counter) and
 * sums them only in words with a change.
 */
#define DEFINE_LOOPS(SUFFIX, T, SHIFT, CMASK)                                                                                  \
    static int scan_##SUFFIX(const void *va, const void *vb, Py_ssize_t n, uint64_t *seen, changes_t *ch) {        \
        const T *a = va, *b = vb;                                                                                  \
        enum { PER = 8 / sizeof(T), W = 8 * sizeof(T) };                                                           \
        uint64_t lane[PER][MAX_CLASSES];                                                                           \
        memset(lane, 0, sizeof lane);                                                                              \
        const unsigned shift = SHIFT;                                                                              \
        const uint64_t cmask = CMASK;                                                                              \
        Py_ssize_t i = 0;                                                                                          \
        size_t at = ch->len, cap = ch->cap;                                                                        \
        uint64_t *restrict rank = ch->rank, *restrict old = ch->old, *restrict new_ = ch->new_, *restrict pos = ch->pos; \
        for (; i < n; i += PER) {                                                                                  \
            const unsigned here = n - i < PER ? (unsigned)(n - i) : PER;                                           \
            uint64_t wa = 0, wb = 0;                                                                               \
            if (__builtin_expect(here == PER, 1)) {                                                                \
                memcpy(&wa, a + i, 8);                                                                             \
                memcpy(&wb, b + i, 8);                                                                             \
            } else {                                                                                               \
                memcpy(&wa, a + i, here * sizeof(T));                                                              \
                memcpy(&wb, b + i, here * sizeof(T));                                                              \
            }                                                                                                      \
            unsigned c[PER];                                                                                       \
            for (unsigned j = 0; j < PER; j++) c[j] = (unsigned)((wa >> (j * W + shift)) & cmask);                 \
            if (__builtin_expect(wa != wb, 0)) {                                                                   \
                if (cap - at < PER) {                                                                              \
                    ch->len = at;                                                                                  \
                    if (reserve(ch)) return -1;                                                                    \
                    cap = ch->cap, rank = ch->rank, old = ch->old, new_ = ch->new_, pos = ch->pos;              \
                }                                                                                                  \
                for (unsigned j = 0; j < PER; j++) { /* branch-free: write every element, keep the changed ones */  \
                    uint64_t r = 0;                                                                                \
                    for (unsigned l = 0; l < PER; l++) r += lane[l][c[j]] + (l < j && c[l] == c[j]);               \
                    rank[at] = r;                                                                                  \
                    pos[at] = (uint64_t)i + j;                                                                     \
                    old[at] = (T)(wa >> (j * W));                                                                  \
                    new_[at] = (T)(wb >> (j * W));                                                                 \
                    at += (T)(wa >> (j * W)) != (T)(wb >> (j * W));                                                \
                }                                                                                                  \
            }                                                                                                      \
            for (unsigned j = 0; j < here; j++) lane[j][c[j]]++;                                                   \
        }                                                                                                          \
        ch->len = at;                                                                                              \
        for (unsigned c = 0; c < MAX_CLASSES; c++) {                                                               \
            seen[c] = 0;                                                                                           \
            for (unsigned l = 0; l < PER; l++) seen[c] += lane[l][c];                                              \
        }                                                                                                          \
        return 0;                                                                                                  \
    }                                                                                                              \
    static Py_ssize_t walk_##SUFFIX(const void *va, Py_ssize_t n, int sm, uint64_t *next, uint64_t *left, dec_t *d, model_t *m, int64_t *pos, \
                                    void *vvals, Py_ssize_t count, const char **err) {                             \
        enum { PER = 8 / sizeof(T), W = 8 * sizeof(T) };                                                           \
        const T *a = va;                                                                                           \
        T *vals = vvals;                                                                                           \
        uint64_t seen[MAX_CLASSES] = {0};                                                                          \
        Py_ssize_t k = 0, i = 0;                                                                                   \
        for (; i + PER <= n; i += PER) {                                                                           \
            uint64_t w;                                                                                            \
            memcpy(&w, a + i, 8);                                                                                  \
            _Pragma("GCC unroll 8") for (unsigned j = 0; j < PER; j++) {                                           \
                const T old = (T)(w >> (j * W));                                                                   \
                WALK_ONE(i + j, old, (unsigned)((old >> (SHIFT)) & (CMASK)));                                      \
            }                                                                                                      \
        }                                                                                                          \
        for (; i < n; i++) WALK_ONE(i, a[i], (unsigned)((a[i] >> (SHIFT)) & (CMASK)));                             \
        return k;                                                                                                  \
    }

typedef int (*scan_fn)(const void *, const void *, Py_ssize_t, uint64_t *, changes_t *);
typedef Py_ssize_t (*walk_fn)(const void *, Py_ssize_t, int, uint64_t *, uint64_t *, dec_t *, model_t *, int64_t *, void *, Py_ssize_t, const char **);

#include "_condblocks.h" /* the walk and the scan in blocks of 64 elements: bwalk_*, bscan_* */

/* One set of loops per class field in use (cond_codec.LAYOUTS), so shifts and masks are constants. */
#define KERNEL(SUFFIX, T, SHIFT, BITS)                                                                             \
    DEFINE_LOOPS(SUFFIX, T, SHIFT, ((1u << BITS) - 1))                                                             \
    DEFINE_BLOCK_WALK(SUFFIX, T, SHIFT, ((1u << BITS) - 1))                                                        \
    DEFINE_BLOCK_SCAN(SUFFIX, T, SHIFT, ((1u << BITS) - 1))
KERNEL(u8, uint8_t, 0, 0)
KERNEL(e8m0, uint8_t, 0, 8)
KERNEL(e4m3, uint8_t, 3, 4)
KERNEL(e5m2, uint8_t, 2, 5)
KERNEL(u16, uint16_t, 0, 0)
KERNEL(f16, uint16_t, 10, 5)
KERNEL(bf16, uint16_t, 7, 8)
KERNEL(u32, uint32_t, 0, 0)
KERNEL(f32, uint32_t, 23, 8)
KERNEL(u64, uint64_t, 0, 0)
KERNEL(f64, uint64_t, 52, 8)

static const struct {
    unsigned itemsize, shift, bits;
    scan_fn scan, bscan, bscan_avx2;
    walk_fn walk, bwalk, bwalk_avx2;
} kernels[] = {
#define ROW(SUFFIX, ITEMSIZE, SHIFT, BITS)                                                                         \
    {ITEMSIZE, SHIFT, BITS, scan_##SUFFIX, BSCAN(SUFFIX), BSCAN_AVX2(SUFFIX), walk_##SUFFIX, BWALK(SUFFIX), BWALK_AVX2(SUFFIX)}
    ROW(u8, 1, 0, 0),  ROW(e8m0, 1, 0, 8), ROW(e4m3, 1, 3, 4), ROW(e5m2, 1, 2, 5), ROW(u16, 2, 0, 0), ROW(f16, 2, 10, 5),
    ROW(bf16, 2, 7, 8), ROW(u32, 4, 0, 0), ROW(f32, 4, 23, 8), ROW(u64, 8, 0, 0), ROW(f64, 8, 52, 8),
#undef ROW
};

static int parse_layout(layout_t *L, Py_ssize_t itemsize, int shift, int class_bits, int sm) {
    for (unsigned i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        if (kernels[i].itemsize == (unsigned)itemsize && kernels[i].shift == (unsigned)shift && kernels[i].bits == (unsigned)class_bits) {
            L->itemsize = (unsigned)itemsize;
            L->width = 8u * (unsigned)itemsize;
            L->shift = (unsigned)shift;
            L->cmask = ((uint64_t)1 << class_bits) - 1;
            L->sm = sm != 0;
            L->kernel = i;
            return 0;
        }
    }
    PyErr_SetString(PyExc_ValueError, "condcoder: no kernel for this element size and class field");
    return -1;
}

static int encode_tensor(const void *a, const void *b, Py_ssize_t n, const layout_t *L, int loops, enc_t *e, Py_ssize_t *count_out) {
    uint64_t seen[MAX_CLASSES] = {0}, first[MAX_CLASSES], changes[MAX_CLASSES] = {0};
    workspace_t *w = workspace_get();
    int avx2;
    const scan_fn scan = !in_blocks(n, loops, &avx2) ? kernels[L->kernel].scan
                         : avx2                      ? kernels[L->kernel].bscan_avx2
                                                     : kernels[L->kernel].bscan;
    if (!w || scan(a, b, n, seen, &w->ch)) return -1;
    model_t *m = w->model;
    const changes_t *ch = &w->ch;
    const Py_ssize_t k = (Py_ssize_t)ch->len;
    /* Backwards: each change's rank becomes the gap to its class's next change (END for its last). */
    for (unsigned c = 0; c < MAX_CLASSES; c++) first[c] = END;
    for (Py_ssize_t j = k - 1; j >= 0; j--) {
        const unsigned c = cls(L, ch->old[j]);
        const uint64_t r = ch->rank[j];
        ch->rank[j] = first[c] == END ? END : first[c] - r - 1;
        first[c] = r;
        changes[c]++;
    }
    *count_out = k;
    e->range = 0xFFFFFFFFu;
    e->cache_size = 1;
    if (k > 0) {
        unsigned had = 0;
        for (unsigned c = 0; c <= L->cmask; c++) {
            enc_number(e, m->cnt_unary[had], m->cnt_mant[had], changes[c]);
            if (changes[c]) enc_number(e, gap_of(m, c)->unary, m->gap[c].mant, first[c]);
            had = changes[c] != 0;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            const uint64_t old = ch->old[j];
            enc_value(e, m, vctx(L, old), old, ch->new_[j], L->width, (int)L->sm);
            if (ch->rank[j] != END) enc_number(e, m->gap[cls(L, old)].unary, m->gap[cls(L, old)].mant, ch->rank[j]);
        }
        enc_flush(e);
    }
    return e->oom ? -1 : 0;
}

static const char *decode_tensor(const void *a, Py_ssize_t n, const unsigned char *data, size_t len, const layout_t *L, int64_t *pos,
                                 void *vals, Py_ssize_t count, int loops, int *oom) {
    uint64_t next[MAX_CLASSES];
    const char *err = NULL;
    workspace_t *w = workspace_get();
    if (!w) {
        *oom = 1;
        return "out of memory";
    }
    model_t *m = w->model;
    dec_t d;
    dec_init(&d, data, len);
    uint64_t left[MAX_CLASSES] = {0}, total = 0;
    unsigned had = 0;
    for (unsigned c = 0; c < MAX_CLASSES; c++) next[c] = END;
    for (unsigned c = 0; c <= L->cmask && !err; c++) {
        left[c] = dec_number(&d, m->cnt_unary[had], m->cnt_mant[had]);
        if (left[c] > (uint64_t)count - total) err = "the class counts add up to more than the index's count";
        else if (left[c]) next[c] = dec_number(&d, gap_of(m, c)->unary, m->gap[c].mant);
        total += left[c];
        had = left[c] != 0;
    }
    if (!err && total != (uint64_t)count) err = "the class counts add up to less than the index's count";
    int avx2;
    const walk_fn walk = !in_blocks(n, loops, &avx2) ? kernels[L->kernel].walk
                         : avx2                      ? kernels[L->kernel].bwalk_avx2
                                                     : kernels[L->kernel].bwalk;
    const Py_ssize_t k = err ? 0 : walk(a, n, (int)L->sm, next, left, &d, m, pos, vals, count, &err);
    if (err) return err;
    if (k < count) return "a gap runs past the end of its class";
    /* The encoder flushes the low end of its final interval, so a canonical stream leaves code 0. */
    if (d.overrun || d.p != d.end || d.code != 0) return "the coded stream does not end exactly after its last change";
    return NULL;
}

/*
 * The change record of the tensor this thread just encoded, as _bitdiff.diff(base, target, itemsize, False)
 * gives it: the positions as LEB128 varint gaps (gap_i = pos_i - pos_{i-1} - 1) and the new bits (itemsize
 * bytes each, little-endian). Both malloc'd (the caller frees them); -1 when out of memory.
 */
static int change_record(unsigned itemsize, unsigned char **gaps, size_t *gaps_len, unsigned char **vals) {
    const changes_t *ch = &((workspace_t *)pthread_getspecific(workspace_key))->ch;
    unsigned char *g = *gaps = malloc(10 * ch->len + 1), *v = *vals = malloc(itemsize * ch->len + 1);
    if (!g || !v) return -1;
    uint64_t next = 0; /* the first position the next gap counts from */
    for (size_t j = 0; j < ch->len; j++) {
        g = put_gap(g, ch->pos[j] - next);
        next = ch->pos[j] + 1;
        memcpy(v + itemsize * j, &ch->new_[j], itemsize);
    }
    *gaps_len = (size_t)(g - *gaps);
    return 0;
}

static PyObject *condcoder_encode(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t itemsize;
    int shift, class_bits, sm, loops = LOOPS_FASTEST, with_change = 0;
    if (!PyArg_ParseTuple(args, "y*y*niip|ip", &a, &b, &itemsize, &shift, &class_bits, &sm, &loops, &with_change)) return NULL;
    layout_t L;
    PyObject *result = NULL;
    if (parse_layout(&L, itemsize, shift, class_bits, sm) < 0) goto done;
    if (a.len != b.len || a.len % itemsize != 0 || ((uintptr_t)a.buf | (uintptr_t)b.buf) % (uintptr_t)itemsize != 0) {
        PyErr_SetString(PyExc_ValueError, "condcoder.encode: buffers must have equal size, a multiple of itemsize, aligned to it");
        goto done;
    }
    enc_t e = {0};
    Py_ssize_t count = 0;
    unsigned char *gaps = NULL, *vals = NULL;
    size_t gaps_len = 0;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = encode_tensor(a.buf, b.buf, a.len / itemsize, &L, loops, &e, &count);
    if (!failed && with_change) failed = change_record((unsigned)itemsize, &gaps, &gaps_len, &vals);
    Py_END_ALLOW_THREADS
    if (failed) PyErr_NoMemory();
    else if (with_change)
        result = Py_BuildValue("ny#y#y#", count, e.data ? (char *)e.data : "", (Py_ssize_t)e.len, (char *)gaps, (Py_ssize_t)gaps_len,
                               (char *)vals, count * itemsize);
    else result = Py_BuildValue("ny#", count, e.data ? (char *)e.data : "", (Py_ssize_t)e.len);
    free(e.data);
    free(gaps);
    free(vals);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

static PyObject *condcoder_decode(PyObject *self, PyObject *args) {
    Py_buffer a, s, pos, vals;
    Py_ssize_t itemsize;
    int shift, class_bits, sm, loops = LOOPS_FASTEST;
    if (!PyArg_ParseTuple(args, "y*y*w*w*niip|i", &a, &s, &pos, &vals, &itemsize, &shift, &class_bits, &sm, &loops)) return NULL;
    layout_t L;
    const char *err = NULL;
    int oom = 0, bad_args = parse_layout(&L, itemsize, shift, class_bits, sm) < 0;
    const Py_ssize_t count = pos.len / 8;
    if (!bad_args && (a.len % itemsize != 0 || ((uintptr_t)a.buf | (uintptr_t)vals.buf) % (uintptr_t)itemsize != 0 || pos.len % 8 != 0 ||
                      ((uintptr_t)pos.buf) % 8 != 0 || vals.len != count * itemsize || count > a.len / itemsize)) {
        PyErr_SetString(PyExc_ValueError, "condcoder.decode: misaligned or mis-sized buffers");
        bad_args = 1;
    }
    if (!bad_args && count > 0) {
        Py_BEGIN_ALLOW_THREADS
        err = decode_tensor(a.buf, a.len / itemsize, s.buf, (size_t)s.len, &L, pos.buf, vals.buf, count, loops, &oom);
        Py_END_ALLOW_THREADS
    } else if (!bad_args && s.len != 0) {
        err = "a tensor without changes has a coded stream";
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&s);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&vals);
    if (bad_args) return NULL;
    if (oom) return PyErr_NoMemory();
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", condcoder_encode, METH_VARARGS,
     "encode(base, target, itemsize, class_shift, class_bits, sign_magnitude, loops=0, with_change=False) -> "
     "(count, stream) or, with_change, (count, stream, varint gaps, new values) as _bitdiff.diff(base, target, "
     "itemsize, False) gives them (loops: 0 the fastest this host has, 1 one element at a time, 2 the SSE2 blocks)"},
    {"decode", condcoder_decode, METH_VARARGS,
     "decode(base, stream, positions_out_int64, values_out, itemsize, class_shift, class_bits, sign_magnitude, loops=0): "
     "decode and validate (loops: as encode's)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_condcoder", "Base-conditioned range coding of patch positions and values.", -1, methods};

PyMODINIT_FUNC PyInit__condcoder(void) {
    rc_init();
    init_layout();
    block_walk_init();
    if (pthread_key_create(&workspace_key, workspace_free)) return PyErr_NoMemory();
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "blocks", block_walk_ok) < 0) Py_CLEAR(mod);
    if (mod && PyModule_AddIntConstant(mod, "avx2", block_avx2_ok) < 0) Py_CLEAR(mod);
    return mod;
}
