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
 *
 * One region: a head (es_rc_head: layout, identity, lock, CLOCK hand, counters), then the
 * index, keys, refs, uses and the slots (es_rc_layout). A process's own cache has it in
 * anonymous memory; a host's cache (rows/_cache.pyx, host=) has it in a file under /dev/shm
 * that every process of the host maps, so ranks share one budget and a row one read brought
 * is a hit for all. The struct is each process's view: pointers into its mapping of the
 * region, plus a working copy of the head's hand, used and counters, loaded by es_rc_lock and
 * stored by es_rc_unlock. So every rule below runs unchanged on either kind, and those fields
 * are read or changed only between the two calls.
 */
#ifndef ENGRAM_ROWCACHE_H
#define ENGRAM_ROWCACHE_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ES_RC_MAGIC 0x45534843524f5753ull  /* "SWORCHSE" */
#define ES_RC_VERSION 1
#define ES_RC_IDENTITY 96                  /* bytes of the identity string, NUL included */

/* The shared part of a cache: its layout (attachers check every field), then the lock and
 * the state the rules change. The lock is a process-shared robust pthread mutex, not a spin
 * lock: a call holds it over up to a window of rows (65536 peeks) and a host runs more ranks
 * than cores, so a waiter must sleep in the kernel rather than spin on a core the holder
 * needs; and a rank killed while holding it (SIGKILL, the OOM killer) hands the next taker
 * EOWNERDEAD from the kernel, where a spin lock would stay taken for good (es_rc_lock). */
typedef struct {
    uint64_t magic;
    int64_t version, head_bytes, total_bytes;
    int64_t nslots, recbytes, stride, entries;
    char identity[ES_RC_IDENTITY];  /* what the rows are (model and layer): attachers compare it */
    pthread_mutex_t mu;
    int64_t hand, used;
    int64_t hits, misses, evictions, bytes_fetched;
    int64_t recoveries;             /* times the rows were forgotten (es_rc_forget): a dead lock holder, garbage */
} es_rc_head;

/* Byte offsets of the region's parts (every part 64-aligned); returns the region's bytes. */
static inline int64_t es_rc_layout(int64_t nslots, int64_t stride, int64_t entries, int64_t *o_index,
                                   int64_t *o_keys, int64_t *o_refs, int64_t *o_uses, int64_t *o_data) {
    int64_t n = nslots > 0 ? nslots : 1, at = ((int64_t)sizeof(es_rc_head) + 63) / 64 * 64;
#define ES_RC_PART(o, bytes) do { *(o) = at; at += ((bytes) + 63) / 64 * 64; } while (0)
    ES_RC_PART(o_index, entries * 8);
    ES_RC_PART(o_keys, n * 8);
    ES_RC_PART(o_refs, n * 4);
    ES_RC_PART(o_uses, n);
    ES_RC_PART(o_data, n * stride);
#undef ES_RC_PART
    return at;
}

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
    int64_t hand, used;    /* working copies of the head's: valid between es_rc_lock and es_rc_unlock */
    int64_t hits, misses, evictions, bytes_fetched;
    es_rc_head *head;
} es_rowcache;

/* Forget every row (a dead lock holder may have left the index half changed or a slot half
 * filled; a probe met an entry no rule could have left): no slot is indexed, and every slot is
 * taken through the CLOCK, which skips the ones live readers still pin (their refs stay; a dead
 * reader's stay too: DESIGN.md section 10). Sets the working copies and the head's alike, so it
 * may run at the lock or anywhere between es_rc_lock and es_rc_unlock. */
static inline void es_rc_forget(es_rowcache *c) {
    int64_t n = c->nslots > 0 ? c->nslots : 1;
    memset(c->index, 0, (size_t)(c->mask + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < n; s++) c->keys[s] = -1;
    memset(c->uses, 0, (size_t)n);
    c->hand = c->head->hand = 0;
    c->used = c->head->used = c->nslots;
    c->head->recoveries++;
}

/* An index entry that names a slot (1..nslots; 0 is empty). Anything else is garbage: a file
 * written by something other than these rules. Every probe checks it before it dereferences. */
static inline int es_rc_entry_ok(const es_rowcache *c, int64_t e) {
    return (uint64_t)(e - 1) < (uint64_t)c->nslots;
}

static inline void es_rc_lock(es_rowcache *c) {
    es_rc_head *h = c->head;
    int e = pthread_mutex_lock(&h->mu);
    if (e == EOWNERDEAD) {  /* its holder died inside: what it was changing cannot be trusted */
        es_rc_forget(c);
        e = pthread_mutex_consistent(&h->mu);
    }
    if (e != 0) {  /* unreachable with the protocol above (every EOWNERDEAD is made consistent) */
        fprintf(stderr, "engram_stream: the row cache lock failed (%s): cannot go on safely\n", strerror(e));
        abort();
    }
    c->hand = h->hand;
    c->used = h->used;
    c->hits = h->hits;
    c->misses = h->misses;
    c->evictions = h->evictions;
    c->bytes_fetched = h->bytes_fetched;
    /* the CLOCK indexes slots by hand and used: out of range they would read and write outside
     * the region, so a head no rule could have left drops the rows instead */
    if (c->hand < 0 || c->hand >= (c->nslots > 0 ? c->nslots : 1) || c->used < 0 || c->used > c->nslots)
        es_rc_forget(c);
}

static inline void es_rc_unlock(es_rowcache *c) {
    es_rc_head *h = c->head;
    h->hand = c->hand;
    h->used = c->used;
    h->hits = c->hits;
    h->misses = c->misses;
    h->evictions = c->evictions;
    h->bytes_fetched = c->bytes_fetched;
    pthread_mutex_unlock(&h->mu);
}

/* The head's lock made afresh: process-shared and robust, unlocked. Only where no other process
 * can be using it (a fresh region, or one its only user attaches: a lock's bytes cannot be asked
 * whether they are process-shared and robust, and zeroed ones would pass for a free lock whose
 * waiters across processes are never woken). Returns 0 or an errno of the mutex's setup. */
static inline int es_rc_init_lock(es_rc_head *h) {
    pthread_mutexattr_t a;
    int e = pthread_mutexattr_init(&a);
    if (!e) e = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (!e) e = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (!e) e = pthread_mutex_init(&h->mu, &a);
    pthread_mutexattr_destroy(&a);
    return e;
}

/* A fresh head for a region of `total` bytes (index zeroed by the caller's fresh memory; keys
 * set free here). Returns 0 or an errno of the mutex's setup. */
static inline int es_rc_init_head(es_rowcache *c, int64_t head_bytes, int64_t total, const char *identity) {
    es_rc_head *h = c->head;
    int e = es_rc_init_lock(h);
    if (e) return e;
    h->version = ES_RC_VERSION;
    h->head_bytes = head_bytes;
    h->total_bytes = total;
    h->nslots = c->nslots;
    h->recbytes = c->recbytes;
    h->stride = c->stride;
    h->entries = c->mask + 1;
    strncpy(h->identity, identity, ES_RC_IDENTITY - 1);
    for (int64_t s = 0; s < (c->nslots > 0 ? c->nslots : 1); s++) c->keys[s] = -1;
    h->hand = h->used = h->hits = h->misses = h->evictions = h->bytes_fetched = h->recoveries = 0;
    h->magic = ES_RC_MAGIC;  /* last: a head with the magic is whole */
    return 0;
}

static inline int64_t es_rc_home(const es_rowcache *c, int64_t row) {
    return (int64_t)(((uint64_t)row * 0x9E3779B97F4A7C15ull) >> c->shift) & c->mask;
}

/* The region as the process attaching it as its only user found it (no live process maps it:
 * rows/_cache.pyx holds its flock exclusive), so nothing changes it meanwhile and any of it may be
 * what no rule leaves: a garbage lock, hand, used, index, key or use counter (a bug, a torn copy,
 * a writer that is not this code). 1: the lock can be taken (a dead holder's is recovered as
 * es_rc_lock does) and every rule's ranges and the index hold (each entry names a distinct slot
 * below used holding a row, reached from its home without an empty entry between; every held row
 * indexed): the rows are kept, and the caller makes the lock afresh (es_rc_init_lock). 0: the
 * caller rebuilds the region whole. seen: nslots bytes of scratch. Ends within a bounded walk (a sound index's probes are short; past 8 per entry the
 * rows are not worth the time and 0 is returned). */
static inline int es_rc_sound(es_rowcache *c, uint8_t *seen) {
    es_rc_head *h = c->head;
    int64_t n = c->nslots, E = c->mask + 1, budget = 8 * E;
    int e = pthread_mutex_trylock(&h->mu);
    if (e == EOWNERDEAD) {
        es_rc_forget(c);
        e = pthread_mutex_consistent(&h->mu);
        if (e) pthread_mutex_unlock(&h->mu);
    }
    if (e) return 0;  /* EBUSY with no live user, EINVAL, ENOTRECOVERABLE: no one could take it */
    int ok = h->entries == E && h->stride == c->stride && h->hand >= 0 && h->hand < (n > 0 ? n : 1)
             && h->used >= 0 && h->used <= n && h->hits >= 0 && h->misses >= 0 && h->evictions >= 0
             && h->bytes_fetched >= 0 && h->recoveries >= 0;
    if (ok) memset(seen, 0, (size_t)(n > 0 ? n : 1));
    for (int64_t s = 0; ok && s < n; s++)
        ok = c->uses[s] <= 3 && c->keys[s] >= -1 && (s < h->used || c->keys[s] == -1);
    for (int64_t i = 0; ok && i < E; i++) {
        int64_t x = c->index[i];
        if (x == 0) continue;
        if (x < 1 || x > h->used || seen[x - 1] || c->keys[x - 1] < 0) { ok = 0; break; }
        seen[x - 1] = 1;
        for (int64_t j = es_rc_home(c, c->keys[x - 1]); ok && j != i; j = (j + 1) & c->mask)
            ok = c->index[j] != 0 && --budget >= 0;
    }
    for (int64_t s = 0; ok && s < n; s++) ok = seen[s] || c->keys[s] < 0;
    pthread_mutex_unlock(&h->mu);
    return ok;
}

/* The slot holding `row`, or -1. Changes nothing (prefetch advice calls it without the lock).
 * At most mask + 1 probes, and an entry that names no slot ends the walk (-1): a garbage index
 * costs misses, never a hang or a read outside the region; the insert that follows the miss
 * walks the same entries and drops them (es_rc_free_entry). */
static inline int64_t es_rc_peek(const es_rowcache *c, int64_t row) {
    if (c->nslots == 0) return -1;
    int64_t i = es_rc_home(c, row);
    for (int64_t n = 0; n <= c->mask; n++) {
        int64_t e = c->index[i];
        if (e == 0 || !es_rc_entry_ok(c, e)) return -1;
        if (c->keys[e - 1] == row) return e - 1;
        i = (i + 1) & c->mask;
    }
    return -1;
}

/* Drop `row` (held by some slot) from the index: backward-shift deletion. 0, or -1 when the index
 * is garbage (the row not found within mask + 1 probes, an entry naming no slot, no empty entry
 * ending the shift): the caller forgets every row. Every loop ends within mask + 1 steps. */
static inline int es_rc_unindex(es_rowcache *c, int64_t row) {
    int64_t i = es_rc_home(c, row), steps = 0, e;
    for (;;) {
        e = c->index[i];
        if (!es_rc_entry_ok(c, e) || ++steps > c->mask + 1) return -1;
        if (c->keys[e - 1] == row) break;
        i = (i + 1) & c->mask;
    }
    int64_t j = i;
    steps = 0;
    for (;;) {
        c->index[i] = 0;
        for (;;) {
            j = (j + 1) & c->mask;
            if (++steps > c->mask + 1) return -1;
            e = c->index[j];
            if (e == 0) return 0;
            if (!es_rc_entry_ok(c, e)) return -1;
            int64_t k = es_rc_home(c, c->keys[e - 1]);
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
        if (c->keys[s] >= 0) {  /* -1: a slot es_rc_forget freed */
            if (es_rc_unindex(c, c->keys[s]) < 0) {
                es_rc_forget(c);  /* frees s too: it is not pinned, so it is this row's */
                return s;
            }
            c->keys[s] = -1;
            c->evictions++;
        }
        return s;
    }
    return -1;
}

/* The empty index entry for `row`: the first after its home. A garbage index (an entry naming no
 * slot, or no empty entry within mask + 1 probes: a sound index is at most half full) is
 * forgotten and the home returned. */
static inline int64_t es_rc_free_entry(es_rowcache *c, int64_t row) {
    int64_t i = es_rc_home(c, row);
    for (int64_t n = 0; n <= c->mask; n++) {
        int64_t e = c->index[i];
        if (e == 0) return i;
        if (!es_rc_entry_ok(c, e)) break;
        i = (i + 1) & c->mask;
    }
    es_rc_forget(c);
    return es_rc_home(c, row);
}

/* Take a slot for `row` (not cached): the caller fills c->data + slot * stride. -1 if none. */
static inline int64_t es_rc_insert(es_rowcache *c, int64_t row) {
    int64_t s = es_rc_victim(c);
    if (s < 0) return -1;
    int64_t i = es_rc_free_entry(c, row);  /* before the slot is keyed: a forget there frees keys */
    c->keys[s] = row;
    c->uses[s] = 0;
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
