/*
 * The patch format's LEB128 varint gaps (DESIGN.md, "The patch format": gap_i = pos_i - pos_{i-1} - 1),
 * written by both C extensions: _bitdiff.c (its change scan) and _condcoder.c (the change record its
 * scan hands the publisher).
 */
#ifndef STITCHBOARD_VARINT_H
#define STITCHBOARD_VARINT_H

#include <stdint.h>

/*
 * Write gap as a LEB128 varint at g (room for 10 bytes); returns the byte after it. Gaps below 16384
 * (nearly all) are written as one or two bytes without a data-dependent branch.
 */
static inline unsigned char *put_gap(unsigned char *g, uint64_t gap) {
    if (gap < 0x4000) {
        const unsigned two = gap >= 0x80;
        g[0] = (unsigned char)((gap & 0x7F) | (two << 7));
        g[1] = (unsigned char)(gap >> 7);
        return g + 1 + two;
    }
    for (; gap >= 0x80; gap >>= 7) *g++ = (unsigned char)(gap | 0x80);
    *g++ = (unsigned char)gap;
    return g;
}

#endif
