/*
 * Class counting 64 elements at a time: the `cond` decoder's walk and encoder's scan in blocks
 * (bwalk_*, bscan_*). Included by _condcoder.c only, after its one-element-at-a-time loops
 * (WALK_ONE, changes_t, reserve, dec_value), where KERNEL instantiates both per element type.
 *
 * The walk must know each element's rank in its class (the count of earlier elements of the same
 * class) to find the changes the stream names by rank. Counted one element at a time, elements of
 * one class wait on each other's counter (~4.5 cycles per element on the CI's 2-core AMD EPYC:
 * 0.2 s for SmolLM2-135M's 135 M elements). Here a block of 64 elements is counted at once: the
 * class of each element as a byte, compared with each of a few "hot" classes (those holding most
 * elements of a sample of the tensor, HOT_MAX at most) in SSE2 registers, one 64-bit mask per hot
 * class and a popcount each; the few elements of other ("cold") classes are counted one by one.
 * A hot class whose next change lies in the block has it at the k-th set bit of its mask
 * (select_bit). x86-64 only (SSE2 and POPCNT, checked at import); elsewhere the one-by-one walk
 * runs. Both walks find the same positions in the same order: the stream is read identically.
 *
 * Each block kernel is built twice: with SSE2 (16-byte compares, four per mask) and, for a CPU
 * that has AVX2 (checked at import, `avx2`), with 32-byte compares, two per mask. Same masks, so
 * the same streams and results. On the CI's 2-core AMD EPYC, one SmolLM2 step's unparted tensors
 * (106 M elements, 0.96 M changes, one thread): decode 0.133 -> 0.119 s, encode 0.098 -> 0.084 s.
 */
#ifndef STITCHBOARD_CONDBLOCKS_H
#define STITCHBOARD_CONDBLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <immintrin.h>
#define BLOCK_WALK 1
#define BLOCK_TARGET __attribute__((target("popcnt")))
#define AVX2_TARGET __attribute__((target("avx2,popcnt")))
#else
#define BLOCK_WALK 0
#define BLOCK_TARGET
#endif

#define HOT_MAX 8            /* hot classes per tensor (each costs ~0.1 cycle per element) */
#define HOT_SAMPLE_BLOCKS 64 /* blocks of 64 elements sampled, evenly spaced, to pick them */
#define HOT_MIN_SHARE 128    /* a hot class holds at least 1/HOT_MIN_SHARE of the sample */

#if BLOCK_WALK
typedef struct {
    unsigned n;
    unsigned cls[HOT_MAX];
    __m128i lanes[HOT_MAX]; /* cls[h] in every byte */
} hot_t;

/* Pick the hot classes from a histogram of the sampled elements' classes (most elements first). */
static void hot_from_counts(hot_t *hot, uint32_t counts[MAX_CLASSES], uint32_t sampled) {
    hot->n = 0;
    while (hot->n < HOT_MAX) {
        unsigned best = 0;
        for (unsigned c = 1; c < MAX_CLASSES; c++)
            if (counts[c] > counts[best]) best = c;
        if (counts[best] == 0 || (uint64_t)counts[best] * HOT_MIN_SHARE < sampled) break;
        hot->lanes[hot->n] = _mm_set1_epi8((char)best);
        hot->cls[hot->n++] = best;
        counts[best] = 0;
    }
}

static int block_walk_ok, block_avx2_ok;

static void block_walk_init(void) {
    __builtin_cpu_init();
    block_walk_ok = __builtin_cpu_supports("popcnt") != 0;
    block_avx2_ok = block_walk_ok && __builtin_cpu_supports("avx2") != 0;
}

/* The 64-bit mask of the bytes of cb[0..63] (in v) equal to the byte in every lane of b. */
static inline __attribute__((always_inline)) uint64_t eq_mask_sse(const __m128i v[4], __m128i b) {
    return (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v[0], b)) |
           (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v[1], b)) << 16 |
           (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v[2], b)) << 32 |
           (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v[3], b)) << 48;
}

/* The index of the (k+1)-th set bit of m (k < popcount(m)): halves, then bytes, then bits. */
static inline __attribute__((always_inline)) unsigned select_bit(uint64_t m, unsigned k) {
    unsigned at = 0;
    const unsigned low32 = (unsigned)__builtin_popcountll(m & 0xFFFFFFFFu);
    if (k >= low32) k -= low32, m >>= 32, at = 32;
    const unsigned low16 = (unsigned)__builtin_popcountll(m & 0xFFFFu);
    if (k >= low16) k -= low16, m >>= 16, at += 16;
    const unsigned low8 = (unsigned)__builtin_popcountll(m & 0xFFu);
    if (k >= low8) k -= low8, m >>= 8, at += 8;
    while (k--) m &= m - 1;
    return at + (unsigned)__builtin_ctzll(m);
}

/* The index of the change of a hot class with mask m in this block, togo of its elements before it
 * (its next rank less its count before the block); 64 when it is not in the block. */
static inline __attribute__((always_inline)) unsigned first_change(uint64_t m, uint64_t togo) {
    return togo < (uint64_t)__builtin_popcountll(m) ? select_bit(m, (unsigned)togo) : 64;
}

/* The 64 bytes at p (32-byte aligned) in four registers. */
static inline __attribute__((always_inline)) void load64_sse(const uint8_t *p, __m128i v[4]) {
    for (unsigned r = 0; r < 4; r++) v[r] = _mm_load_si128((const __m128i *)(p + 16 * r));
}

/* The hot classes' masks (mh[h]) of a block whose classes are the 64 bytes at cb (32-byte aligned), lanes[h] the
 * h-th hot class in every byte; returns the mask of the elements of any hot class. */
static inline __attribute__((always_inline)) uint64_t hot_masks_sse(unsigned n, const __m128i *lanes, const uint8_t *cb,
                                                                    uint64_t mh[HOT_MAX]) {
    __m128i v[4];
    load64_sse(cb, v);
    uint64_t covered = 0;
    for (unsigned h = 0; h < n; h++) covered |= mh[h] = eq_mask_sse(v, lanes[h]);
    return covered;
}

/* eq_mask_sse, load64_sse and hot_masks_sse with 32-byte registers (AVX2): two compares per mask, not four. */
static inline __attribute__((always_inline, target("avx2"))) uint64_t eq_mask_avx2(const __m256i v[2], __m256i b) {
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v[0], b)) |
           (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v[1], b)) << 32;
}

static inline __attribute__((always_inline, target("avx2"))) void load64_avx2(const uint8_t *p, __m256i v[2]) {
    for (unsigned r = 0; r < 2; r++) v[r] = _mm256_load_si256((const __m256i *)(p + 32 * r));
}

static inline __attribute__((always_inline, target("avx2"))) uint64_t hot_masks_avx2(unsigned n, const __m256i *lanes,
                                                                                    const uint8_t *cb, uint64_t mh[HOT_MAX]) {
    __m256i v[2];
    load64_avx2(cb, v);
    uint64_t covered = 0;
    for (unsigned h = 0; h < n; h++) covered |= mh[h] = eq_mask_avx2(v, lanes[h]);
    return covered;
}

/* Per instruction set: its registers (VEC_*, NVEC_* of them per block), the hot classes' lanes declared as lanes_
 * from hot_t h (LANES_*), and an all-zero register (ZERO_*). */
#define VEC_sse __m128i
#define NVEC_sse 4
#define LANES_sse(h) const __m128i *lanes_ = (h).lanes
#define ZERO_sse _mm_setzero_si128()
#define VEC_avx2 __m256i
#define NVEC_avx2 2
#define LANES_avx2(h)                                                                                              \
    __m256i lanes_[HOT_MAX];                                                                                       \
    for (unsigned h_ = 0; h_ < (h).n; h_++) lanes_[h_] = _mm256_set1_epi8((char)(h).cls[h_])
#define ZERO_avx2 _mm256_setzero_si256()

/* hot = the hot classes of the n elements at a (type T), sampled in HOT_SAMPLE_BLOCKS blocks evenly spaced. */
#define PICK_HOT(hot, a, n, SHIFT, CMASK)                                                                          \
    do {                                                                                                           \
        const Py_ssize_t blocks_ = (n) / 64, stride_ = blocks_ > HOT_SAMPLE_BLOCKS ? blocks_ / HOT_SAMPLE_BLOCKS : 1; \
        uint32_t counts_[MAX_CLASSES] = {0}, sampled_ = 0;                                                         \
        for (Py_ssize_t b_ = 0; b_ < blocks_ && sampled_ < 64 * HOT_SAMPLE_BLOCKS; b_ += stride_, sampled_ += 64) \
            for (unsigned j_ = 0; j_ < 64; j_++) counts_[((a)[64 * b_ + j_] >> (SHIFT)) & (CMASK)]++;              \
        hot_from_counts(&(hot), counts_, sampled_);                                                                \
    } while (0)

/* Bits 0 .. p-1 (p <= 64). */
static inline __attribute__((always_inline)) uint64_t below(unsigned p) { return p >= 64 ? UINT64_MAX : ((uint64_t)1 << p) - 1; }
#else
static const int block_walk_ok = 0, block_avx2_ok = 0;
static void block_walk_init(void) {}
#endif

/* Which loops count the classes (the `loops` argument of encode and decode): the fastest this host has, one
 * element at a time, or the SSE2 blocks on a host that has AVX2 too (so tests can compare all three). */
enum { LOOPS_FASTEST = 0, LOOPS_ONE_BY_ONE = 1, LOOPS_SSE2 = 2 };

/* Whether a tensor of n elements is walked or scanned in blocks, and with AVX2 (*avx2). */
static inline int in_blocks(Py_ssize_t n, int loops, int *avx2) {
    *avx2 = block_avx2_ok && loops != LOOPS_SSE2;
    return block_walk_ok && n >= 64 && loops != LOOPS_ONE_BY_ONE;
}

#if BLOCK_WALK
/*
 * The walk in blocks of 64 elements: per block the hot classes' masks; then, from
 * the first element not yet counted, the first change: a hot class's (its next rank less its count
 * so far is below its elements left in the block: that set bit) or a cold element found one by
 * one; the hot elements before it are counted by popcount, the change decoded as WALK_ONE does.
 */
#define DEFINE_BLOCK_WALK_ISA(ISA, TARGET, SUFFIX, T, SHIFT, CMASK)                                                 \
    static TARGET Py_ssize_t bwalk_##ISA##_##SUFFIX(const void *va, Py_ssize_t n, int sm, uint64_t *next, uint64_t *left, \
                                                   dec_t *d, model_t *m, int64_t *pos, void *vvals, Py_ssize_t count, \
                                                   const char **err) {                                              \
        enum { W = 8 * sizeof(T) };                                                                                \
        const T *a = va;                                                                                           \
        T *vals = vvals;                                                                                           \
        uint64_t seen[MAX_CLASSES] = {0};                                                                          \
        uint8_t cb[64] __attribute__((aligned(32)));                                                               \
        Py_ssize_t k = 0, i = 0;                                                                                   \
        hot_t hot;                                                                                                 \
        PICK_HOT(hot, a, n, SHIFT, CMASK);                                                                         \
        LANES_##ISA(hot);                                                                                          \
        for (; i + 64 <= n; i += 64) {                                                                             \
            for (unsigned j = 0; j < 64; j++) cb[j] = (uint8_t)((a[i + j] >> (SHIFT)) & (CMASK));                  \
            uint64_t mh[HOT_MAX];                                                                                  \
            const uint64_t covered = hot_masks_##ISA(hot.n, lanes_, cb, mh);                                       \
            unsigned cand[HOT_MAX];                                                                                \
            for (unsigned h = 0; h < hot.n; h++) {                                                                 \
                cand[h] = first_change(mh[h], next[hot.cls[h]] - seen[hot.cls[h]]);                                \
            }                                                                                                      \
            uint64_t cold = ~covered;                                                                              \
            for (;;) {                                                                                             \
                unsigned p = 64, hp = HOT_MAX;                                                                     \
                for (unsigned h = 0; h < hot.n; h++)                                                               \
                    if (cand[h] < p) p = cand[h], hp = h;                                                          \
                for (; cold & below(p); cold &= cold - 1) {                                                        \
                    const unsigned j = (unsigned)__builtin_ctzll(cold);                                            \
                    if (seen[cb[j]] == next[cb[j]]) {                                                              \
                        p = j, hp = HOT_MAX;                                                                       \
                        break;                                                                                     \
                    }                                                                                              \
                    seen[cb[j]]++;                                                                                 \
                }                                                                                                  \
                if (p == 64) break;                                                                                \
                const unsigned c = cb[p];                                                                          \
                const T old = a[i + p];                                                                            \
                const uint64_t r_ = next[c];                                                                       \
                if (hp == HOT_MAX) seen[c]++, cold &= cold - 1;                                                    \
                pos[k] = i + p;                                                                                    \
                vals[k] = (T)dec_value(d, m, 2 * c + (unsigned)(old >> (W - 1)), old, W, sm, err);                 \
                if (++k == count || *err) return k;                                                                \
                next[c] = --left[c] ? r_ + 1 + dec_number(d, m->gap[c].unary, m->gap[c].mant) : END;               \
                if (hp < HOT_MAX) cand[hp] = first_change(mh[hp], next[c] - seen[c]);                              \
            }                                                                                                      \
            for (unsigned h = 0; h < hot.n; h++) seen[hot.cls[h]] += (uint64_t)__builtin_popcountll(mh[h]);        \
        }                                                                                                          \
        for (; i < n; i++) WALK_ONE(i, a[i], (unsigned)((a[i] >> (SHIFT)) & (CMASK)));                             \
        return k;                                                                                                  \
    }
/*
 * The encoder's scan in blocks of 64 elements: each changed element's rank is its class's count
 * before the block plus, for a hot class, the popcount of its mask below it; the block's cold
 * elements are counted one by one first, keeping the ranks of the changed ones.
 */
#define DEFINE_BLOCK_SCAN_ISA(ISA, TARGET, SUFFIX, T, SHIFT, CMASK)                                                 \
    static TARGET int bscan_##ISA##_##SUFFIX(const void *va, const void *vb, Py_ssize_t n, uint64_t *seen, changes_t *ch) { \
        const T *a = va, *b = vb;                                                                                  \
        uint8_t cb[64] __attribute__((aligned(32))), ne[64] __attribute__((aligned(32)));                          \
        uint64_t cold_rank[64];                                                                                    \
        int hot_of[MAX_CLASSES];                                                                                   \
        hot_t hot;                                                                                                 \
        PICK_HOT(hot, a, n, SHIFT, CMASK);                                                                         \
        LANES_##ISA(hot);                                                                                          \
        for (unsigned c = 0; c < MAX_CLASSES; c++) seen[c] = 0, hot_of[c] = -1;                                    \
        for (unsigned h = 0; h < hot.n; h++) hot_of[hot.cls[h]] = (int)h;                                          \
        const VEC_##ISA zero = ZERO_##ISA;                                                                         \
        Py_ssize_t i = 0;                                                                                          \
        for (; i + 64 <= n; i += 64) {                                                                             \
            for (unsigned j = 0; j < 64; j++) {                                                                    \
                cb[j] = (uint8_t)((a[i + j] >> (SHIFT)) & (CMASK));                                                \
                ne[j] = a[i + j] != b[i + j];                                                                      \
            }                                                                                                      \
            uint64_t mh[HOT_MAX];                                                                                  \
            const uint64_t covered = hot_masks_##ISA(hot.n, lanes_, cb, mh);                                       \
            VEC_##ISA d[NVEC_##ISA];                                                                               \
            load64_##ISA(ne, d);                                                                                   \
            uint64_t changed = ~eq_mask_##ISA(d, zero);                                                            \
            for (uint64_t cold = ~covered; cold; cold &= cold - 1) {                                               \
                const unsigned j = (unsigned)__builtin_ctzll(cold);                                                \
                cold_rank[j] = seen[cb[j]]++;                                                                      \
            }                                                                                                      \
            if (changed) {                                                                                         \
                if (ch->cap - ch->len < 64 && reserve(ch)) return -1;                                              \
                for (; changed; changed &= changed - 1) {                                                          \
                    const unsigned j = (unsigned)__builtin_ctzll(changed), c = cb[j];                               \
                    const int h = hot_of[c];                                                                       \
                    ch->rank[ch->len] = h < 0 ? cold_rank[j] : seen[c] + (uint64_t)__builtin_popcountll(mh[h] & below(j)); \
                    ch->old[ch->len] = a[i + j], ch->pos[ch->len] = (uint64_t)(i + j);                             \
                    ch->new_[ch->len++] = b[i + j];                                                                \
                }                                                                                                  \
            }                                                                                                      \
            for (unsigned h = 0; h < hot.n; h++) seen[hot.cls[h]] += (uint64_t)__builtin_popcountll(mh[h]);        \
        }                                                                                                          \
        for (; i < n; i++) {                                                                                       \
            const unsigned c = (unsigned)((a[i] >> (SHIFT)) & (CMASK));                                            \
            if (a[i] != b[i]) {                                                                                    \
                if (ch->cap == ch->len && reserve(ch)) return -1;                                                  \
                ch->rank[ch->len] = seen[c], ch->old[ch->len] = a[i], ch->pos[ch->len] = (uint64_t)i;          \
                ch->new_[ch->len++] = b[i];                                                                        \
            }                                                                                                      \
            seen[c]++;                                                                                             \
        }                                                                                                          \
        return 0;                                                                                                  \
    }
#define DEFINE_BLOCK_WALK(SUFFIX, T, SHIFT, CMASK)                                                                 \
    DEFINE_BLOCK_WALK_ISA(sse, BLOCK_TARGET, SUFFIX, T, SHIFT, CMASK)                                              \
    DEFINE_BLOCK_WALK_ISA(avx2, AVX2_TARGET, SUFFIX, T, SHIFT, CMASK)
#define DEFINE_BLOCK_SCAN(SUFFIX, T, SHIFT, CMASK)                                                                 \
    DEFINE_BLOCK_SCAN_ISA(sse, BLOCK_TARGET, SUFFIX, T, SHIFT, CMASK)                                              \
    DEFINE_BLOCK_SCAN_ISA(avx2, AVX2_TARGET, SUFFIX, T, SHIFT, CMASK)
#define BWALK(SUFFIX) bwalk_sse_##SUFFIX
#define BSCAN(SUFFIX) bscan_sse_##SUFFIX
#define BWALK_AVX2(SUFFIX) bwalk_avx2_##SUFFIX
#define BSCAN_AVX2(SUFFIX) bscan_avx2_##SUFFIX
#else
#define DEFINE_BLOCK_SCAN(SUFFIX, T, SHIFT, CMASK)
#define BSCAN(SUFFIX) NULL
#define BSCAN_AVX2(SUFFIX) NULL
#define DEFINE_BLOCK_WALK(SUFFIX, T, SHIFT, CMASK)
#define BWALK(SUFFIX) NULL
#define BWALK_AVX2(SUFFIX) NULL
#endif

#endif
