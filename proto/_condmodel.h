/*
 * The context model of the `cond` patch encoding (format: proto/cond_codec.py) and the per-thread
 * workspace that holds it. Included by _condcoder.c only, after _rangecoder.h.
 */
#ifndef STITCHBOARD_CONDMODEL_H
#define STITCHBOARD_CONDMODEL_H

#include <pthread.h>
#include <string.h>

#define MAX_CLASSES 256 /* class_bits <= 8 */

/*
 * The model of one tensor, in blocks. Per tensor: cnt_unary and cnt_mant code each class's
 * number of changes n as the bucket (bit length of n + 1, minus one) in unary and the two bits
 * under its leading one, with context "the previous class had changes". Per position class
 * c (gap_model_t): unary, "u > i" of a gap's bucket u (bit length of g + 1, minus one); mant,
 * the two bits under the leading one of g + 1 per u. Per value context v = 2c + top bit of
 * the base element (val_model_t): the step's sign, and per sign s the unary code of the
 * magnitude's bucket ("bucket > i"). Per (v, s, bucket b >= 2) a magnitude block (mag_of):
 * the first min(b - 1, TREE_BITS) bits under the leading one as a bit tree (node 1 ..), then
 * POS_BITS models, one per further bit position; deeper bits are coded flat.
 *
 * Each thread keeps one model and reuses it tensor after tensor: a block is zeroed when first
 * used under a new generation `gen`, so a tensor costs only the blocks it uses, and the memory
 * (calloc'd, mostly never touched) is not faulted in again per tensor.
 */
#define TREE_BITS 8
#define POS_BITS 16
typedef struct {
    uint32_t stamp;
    bit_t unary[NUMBER_BUCKETS];
    bit_t mant[NUMBER_BUCKETS][3];
} gap_model_t;

typedef struct {
    uint32_t stamp;
    bit_t sign;
    bit_t unary[2][65];
} val_model_t;

typedef struct {
    uint32_t gen;
    bit_t cnt_unary[2][NUMBER_BUCKETS], cnt_mant[2][NUMBER_BUCKETS][3];
    gap_model_t gap[MAX_CLASSES];
    val_model_t val[2 * MAX_CLASSES];
    bit_t mag[]; /* per bucket b, 4 * MAX_CLASSES blocks of mag_words[b] words: a stamp, then the models */
} model_t;

static size_t mag_at[66], mag_words[65], model_bytes;

static void init_layout(void) {
    size_t at = 0;
    for (unsigned b = 2; b <= 64; b++) {
        mag_words[b] = 1 + (1u << (b - 1 < TREE_BITS ? b - 1 : TREE_BITS)) + POS_BITS;
        mag_at[b] = at;
        at += 4 * MAX_CLASSES * mag_words[b];
    }
    model_bytes = sizeof(model_t) + at * sizeof(bit_t);
}

/* The changed elements of a tensor, in position order: rank within its class, old and new bits, position. */
typedef struct {
    uint64_t *rank, *old, *new_, *pos;
    size_t len, cap;
} changes_t;

/* Per thread, reused tensor after tensor: the model and the encoder's change arrays. */
typedef struct {
    model_t *model;
    changes_t ch;
} workspace_t;

static pthread_key_t workspace_key;

static void workspace_free(void *p) {
    workspace_t *w = p;
    free(w->model);
    free(w->ch.rank);
    free(w->ch.old);
    free(w->ch.new_);
    free(w->ch.pos);
    free(w);
}

/* This thread's workspace, its model at a fresh generation and no changes; NULL when out of memory. */
static workspace_t *workspace_get(void) {
    workspace_t *w = pthread_getspecific(workspace_key);
    if (!w) {
        if (!(w = calloc(1, sizeof *w)) || !(w->model = calloc(1, model_bytes)) || pthread_setspecific(workspace_key, w)) {
            if (w) workspace_free(w);
            return NULL;
        }
    }
    model_t *m = w->model;
    if (++m->gen == 0) { /* stamps wrapped after 2^32 tensors */
        memset(m, 0, model_bytes);
        m->gen = 1;
    }
    memset(m->cnt_unary, 0, sizeof m->cnt_unary);
    memset(m->cnt_mant, 0, sizeof m->cnt_mant);
    w->ch.len = 0;
    return w;
}

static inline gap_model_t *gap_of(model_t *m, unsigned c) {
    gap_model_t *g = &m->gap[c];
    if (g->stamp != m->gen) {
        memset(g, 0, sizeof *g);
        g->stamp = m->gen;
    }
    return g;
}

static inline val_model_t *val_of(model_t *m, unsigned v) {
    val_model_t *g = &m->val[v];
    if (g->stamp != m->gen) {
        memset(g, 0, sizeof *g);
        g->stamp = m->gen;
    }
    return g;
}

static inline bit_t *mag_of(model_t *m, unsigned v, unsigned s, unsigned b) {
    bit_t *blk = m->mag + mag_at[b] + (2 * v + s) * mag_words[b];
    uint32_t stamp;
    memcpy(&stamp, blk, sizeof stamp);
    if (stamp != m->gen) {
        memset(blk, 0, mag_words[b] * sizeof(bit_t));
        memcpy(blk, &m->gen, sizeof stamp);
    }
    return blk + 1;
}

#endif
