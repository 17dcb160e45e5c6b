/* engram_rowcache.h: a RAM cache of whole table rows, keyed by absolute row.
 *
 * A fixed number of slots, each holding one row *record* (the row's bytes in the
 * table's dtype, then its scale bytes for int8 tables), so a hit is converted to
 * float exactly as the table row would be. Lookup: open addressing over a power-of-
 * two index (linear probing, backward-shift deletion: no tombstones, so probe
 * lengths stay short however long the decode runs).
 *
 * Eviction: CLOCK with a 2-bit use counter (GCLOCK). A Zipf token stream gives a
 * few rows that are read again and again and a long tail read once (most n-gram
 * rows of the higher orders): a new row enters with counter 0 and is the first to
 * go when the hand passes, unless it was read again meanwhile; a hot row earns up
 * to 3 passes. A hit only bumps a byte (no list to relink), so the lookup stays a
 * few loads in the nogil step.
 *
 * Pinning: a cache is shared by every reader of its layer (engines on different
 * threads, under the owner's lock: rows/_source.pyx CachedRows), and pins by count:
 * refs[s] > 0 while any reader still reads slot s, so the hand skips it and no
 * reader's rows are evicted by its own or another's fills.
 * Stateless functions over a struct the caller owns; nothing here allocates or
 * fails loudly (a full-of-pins cache returns -1).
 */
#ifndef ENGRAM_ROWCACHE_H
#define ENGRAM_ROWCACHE_H

#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t nslots;        /* rows it can hold (may be 0: every lookup misses) */
    int64_t recbytes;      /* bytes of one row record */
    int64_t stride;        /* bytes between slots (recbytes rounded up to 64) */
    int64_t mask;          /* index entries - 1 (a power of two >= 2 * nslots) */
    int shift;             /* 64 - log2(index entries): the hash keeps the top bits */
    int64_t *index;        /* [mask + 1] slot + 1, 0 = empty */
    int64_t *keys;         /* [nslots] absolute row held, -1 = free */
    uint8_t *uses;         /* [nslots] CLOCK counter, 0..3 */
    int32_t *refs;         /* [nslots] readers still reading the slot */
    char *data;            /* [nslots * stride] records */
    int64_t hand, used;
    int64_t hits, misses, evictions, bytes_fetched;
} es_rowcache;

static inline int64_t es_rc_home(const es_rowcache *c, int64_t row) {
    return (int64_t)(((uint64_t)row * 0x9E3779B97F4A7C15ull) >> c->shift) & c->mask;
}

/* The slot holding `row`, or -1. Changes nothing. */
static inline int64_t es_rc_peek(const es_rowcache *c, int64_t row) {
    if (c->nslots == 0) return -1;
    int64_t i = es_rc_home(c, row);
    for (;;) {
        int64_t e = c->index[i];
        if (e == 0) return -1;
        if (c->keys[e - 1] == row) return e - 1;
        i = (i + 1) & c->mask;
    }
}

/* Drop `row` (held by some slot) from the index: backward-shift deletion. */
static inline void es_rc_unindex(es_rowcache *c, int64_t row) {
    int64_t i = es_rc_home(c, row);
    while (c->keys[c->index[i] - 1] != row) i = (i + 1) & c->mask;
    int64_t j = i;
    for (;;) {
        c->index[i] = 0;
        for (;;) {
            j = (j + 1) & c->mask;
            if (c->index[j] == 0) return;
            int64_t k = es_rc_home(c, c->keys[c->index[j] - 1]);
            /* entry j may move back to i unless its home lies cyclically in (i, j] */
            if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
            break;
        }
        c->index[i] = c->index[j];
        i = j;
    }
}

/* A slot for a new row: a free one, else the CLOCK victim (not pinned now). -1 if none. */
static inline int64_t es_rc_victim(es_rowcache *c) {
    if (c->used < c->nslots) return c->used++;
    for (int64_t n = 0; n < 5 * c->nslots; n++) {  /* 4 passes bring any counter to 0 */
        int64_t s = c->hand;
        c->hand = (s + 1 == c->nslots) ? 0 : s + 1;
        if (c->refs[s] > 0) continue;
        if (c->uses[s]) { c->uses[s]--; continue; }
        es_rc_unindex(c, c->keys[s]);
        c->keys[s] = -1;
        c->evictions++;
        return s;
    }
    return -1;
}

/* Take a slot for `row` (not cached): the caller fills c->data + slot * stride. -1 if none. */
static inline int64_t es_rc_insert(es_rowcache *c, int64_t row) {
    int64_t s = es_rc_victim(c);
    if (s < 0) return -1;
    c->keys[s] = row;
    c->uses[s] = 0;
    int64_t i = es_rc_home(c, row);
    while (c->index[i]) i = (i + 1) & c->mask;
    c->index[i] = s + 1;
    return s;
}

static inline const char *es_rc_hit(es_rowcache *c, int64_t s) {
    if (c->uses[s] < 3) c->uses[s]++;
    c->hits++;
    return c->data + s * c->stride;
}

/* Local source: the record of `row`, from the cache or copied into it from the table
 * (row bytes at table + row * rowbytes, then for int8 the scale at scale + row * scalebytes).
 * Returns NULL only when the cache has no slot to give (nslots == 0): read the table then. */
static inline const char *es_rc_row(es_rowcache *c, int64_t row, const char *table, int64_t rowbytes,
                                    const char *scale, int64_t scalebytes) {
    int64_t s = es_rc_peek(c, row);
    if (s >= 0) return es_rc_hit(c, s);
    c->misses++;
    s = es_rc_insert(c, row);
    if (s < 0) return NULL;
    char *d = c->data + s * c->stride;
    memcpy(d, table + row * rowbytes, (size_t)rowbytes);
    if (scale) memcpy(d + rowbytes, scale + row * scalebytes, (size_t)scalebytes);
    c->bytes_fetched += c->recbytes;
    return d;
}

#endif /* ENGRAM_ROWCACHE_H */
