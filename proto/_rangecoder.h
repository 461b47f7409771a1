/*
 * The adaptive binary range coder of the `cond` patch encoding (format: proto/cond_codec.py).
 *
 * The carry-propagating range coder of LZMA (Igor Pavlov, public domain), minus its first output
 * byte (always 0), with 16-bit count-adaptive probabilities: a KT-like estimate whose window
 * grows to ADAPT_LIMIT observations. Also the coding of a number x >= 0 (gaps, counts) as a
 * unary bucket and the bits under its leading one. Included by _condcoder.c only.
 */
#ifndef STITCHBOARD_RANGECODER_H
#define STITCHBOARD_RANGECODER_H

#include <stdint.h>
#include <stdlib.h>

#define ADAPT_LIMIT 126 /* observations after which a probability adapts at a fixed rate (62-1022 give the same sizes) */
#define PROB_ONE 65536u
#define PROB_MIN 32u
#define TOP (1u << 24)

/*
 * ---- adaptive bit model ----
 * P(bit == 0) = (q ^ 0x8000) / 65536, so an all-zero model means p = 1/2 with no observations
 * (a model needs no initialisation beyond zeroed memory); n counts observations up to
 * ADAPT_LIMIT and sets the update rate 1 / (n + 2).
 */
typedef struct {
    uint16_t q, n;
} bit_t;

static uint32_t adapt_rate[ADAPT_LIMIT + 1]; /* 65536 / (n + 2), filled by rc_init */

static inline uint32_t prob(const bit_t *m) { return (uint32_t)(m->q ^ 0x8000u); }

static inline void update(bit_t *m, unsigned bit) {
    const uint32_t r = adapt_rate[m->n], p = prob(m);
    uint32_t q = bit ? p - ((p * r) >> 16) : p + (((PROB_ONE - p) * r) >> 16);
    q = q < PROB_MIN ? PROB_MIN : q > PROB_ONE - PROB_MIN ? PROB_ONE - PROB_MIN : q;
    m->q = (uint16_t)(q ^ 0x8000u);
    m->n = (uint16_t)(m->n + (m->n < ADAPT_LIMIT));
}

#define NUMBER_BUCKETS 63 /* a number x < 2^63 - 1: its bucket bitlen(x + 1) - 1 is at most 62 */

static void rc_init(void) {
    for (unsigned n = 0; n <= ADAPT_LIMIT; n++) adapt_rate[n] = PROB_ONE / (n + 2);
}

static inline unsigned bit_length(uint64_t x) { return x ? 64u - (unsigned)__builtin_clzll(x) : 0u; }

/* ---- range encoder ---- */
typedef struct {
    unsigned char *data;
    size_t len, cap;
    uint64_t low;
    uint32_t range;
    unsigned char cache;
    uint64_t cache_size;
    int started; /* the first byte the LZMA coder emits is always 0: it is not stored */
    int oom;
} enc_t;

static void put_byte(enc_t *e, unsigned char b) {
    if (!e->started) {
        e->started = 1;
        return;
    }
    if (e->len == e->cap) {
        size_t cap = e->cap ? 2 * e->cap : 4096;
        unsigned char *p = realloc(e->data, cap);
        if (!p) {
            e->oom = 1;
            return;
        }
        e->data = p;
        e->cap = cap;
    }
    e->data[e->len++] = b;
}

static void shift_low(enc_t *e) {
    if ((uint32_t)e->low < 0xFF000000u || (e->low >> 32) != 0) {
        const unsigned char carry = (unsigned char)(e->low >> 32);
        unsigned char temp = e->cache;
        do {
            put_byte(e, (unsigned char)(temp + carry));
            temp = 0xFF;
        } while (--e->cache_size != 0);
        e->cache = (unsigned char)(e->low >> 24);
    }
    e->cache_size++;
    e->low = (e->low & 0x00FFFFFFu) << 8;
}

static inline void enc_bit(enc_t *e, bit_t *m, unsigned bit) {
    const uint32_t bound = (e->range >> 16) * prob(m);
    e->low += bound & (0u - bit);
    e->range = bit ? e->range - bound : bound;
    update(m, bit);
    while (e->range < TOP) {
        e->range <<= 8;
        shift_low(e);
    }
}

static inline void enc_direct(enc_t *e, uint64_t value, unsigned nbits) {
    while (nbits--) {
        e->range >>= 1;
        if ((value >> nbits) & 1) e->low += e->range;
        while (e->range < TOP) {
            e->range <<= 8;
            shift_low(e);
        }
    }
}

static void enc_flush(enc_t *e) {
    for (int i = 0; i < 5; i++) shift_low(e);
}

/* ---- range decoder: bytes past the end read as 0 and are counted, so a short stream fails the length check ---- */
typedef struct {
    const unsigned char *p, *end;
    size_t overrun;
    uint32_t range, code;
} dec_t;

static inline unsigned char next_byte(dec_t *d) {
    if (d->p < d->end) return *d->p++;
    d->overrun++;
    return 0;
}

static void dec_init(dec_t *d, const unsigned char *data, size_t len) {
    d->p = data;
    d->end = data + len;
    d->overrun = 0;
    d->range = 0xFFFFFFFFu;
    d->code = 0;
    for (int i = 0; i < 4; i++) d->code = (d->code << 8) | next_byte(d);
}

static inline unsigned dec_bit(dec_t *d, bit_t *m) {
    const uint32_t bound = (d->range >> 16) * prob(m);
    const unsigned bit = d->code >= bound;
    d->code -= bound & (0u - bit);
    d->range = bit ? d->range - bound : bound;
    update(m, bit);
    while (d->range < TOP) {
        d->range <<= 8;
        d->code = (d->code << 8) | next_byte(d);
    }
    return bit;
}

static inline uint64_t dec_direct(dec_t *d, unsigned nbits) {
    uint64_t v = 0;
    while (nbits--) {
        d->range >>= 1;
        unsigned bit = d->code >= d->range;
        if (bit) d->code -= d->range;
        v = (v << 1) | bit;
        while (d->range < TOP) {
            d->range <<= 8;
            d->code = (d->code << 8) | next_byte(d);
        }
    }
    return v;
}

/*
 * ---- gaps and counts: x >= 0 as the bucket u = bitlen(x + 1) - 1 in unary, then the bits of
 * x + 1 under its leading one: the first with mant[u][0], the second with mant[u][1 + first],
 * the rest flat ----
 */
static void enc_number(enc_t *e, bit_t *unary, bit_t (*mant)[3], uint64_t x) {
    const unsigned u = bit_length(x + 1) - 1;
    for (unsigned i = 0; i < NUMBER_BUCKETS - 1; i++) {
        enc_bit(e, &unary[i], u > i);
        if (u == i) break;
    }
    if (u == 0) return;
    const uint64_t rest = (x + 1) - ((uint64_t)1 << u);
    const unsigned b1 = (unsigned)(rest >> (u - 1)) & 1;
    enc_bit(e, &mant[u][0], b1);
    if (u == 1) return;
    enc_bit(e, &mant[u][1 + b1], (unsigned)(rest >> (u - 2)) & 1);
    enc_direct(e, rest, u - 2);
}

static uint64_t dec_number(dec_t *d, bit_t *unary, bit_t (*mant)[3]) {
    unsigned u = 0;
    while (u < NUMBER_BUCKETS - 1 && dec_bit(d, &unary[u])) u++;
    if (u == 0) return 0;
    const unsigned b1 = dec_bit(d, &mant[u][0]);
    uint64_t rest = b1;
    if (u >= 2) {
        rest = (rest << 1) | dec_bit(d, &mant[u][1 + b1]);
        rest = (rest << (u - 2)) | dec_direct(d, u - 2);
    }
    return ((uint64_t)1 << u) + rest - 1;
}

#endif
