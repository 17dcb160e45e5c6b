/* engram_io.h: table row records read from files with pread, page by page, over an I/O pool.
 *
 * A row *record* (what a row cache slot holds: the row's bytes, then its scale bytes) is made
 * of one or two *parts*, each read from its own extent of a file (or copied from memory):
 *
 *   V4.1 shards       embed.weight [N, 256] and embed.scale [N, 8] (two extents, maybe two files)
 *   packed row file   one extent of 4 KiB pages holding 15 whole 264-byte records each
 *   scales in RAM     the weight part from the file, the scale part from memory
 *   demo tables       the table [N, row bytes], and for int8 tables the float32 scales
 *
 * A part's byte offset of row r is  base + (r / per_group) * group_bytes + (r % per_group) * bytes
 * (a plain tensor: per_group 1, group_bytes = bytes; the packed file: 15 per 4096-byte group).
 *
 * Checksums (the packed file: sums >= 0): a group holds, from byte `sums` of the group, one
 * 8-byte little-endian checksum per record slot, es_io_sum of the record's bytes seeded with
 * seed + row (a record written at another row, or another layer's, fails too). A span reads the
 * pages of its rows' records and their checksums (the same page for records of a page group),
 * and every record copied out is checked first: a mismatch is ES_IO_BADSUM, the row in the job.
 *
 * Reading a batch (es_io_plan, then a job): the distinct rows, sorted, give each file part's
 * byte ranges in file order; ranges that share a 4 KiB page merge into one *span* (so a page is
 * read once however many rows it serves: a record that straddles two pages is one 8 KiB read).
 * Spans are page aligned in offset and length, so the same reads work with O_DIRECT (aligned
 * buffers from the pool) and buffered. Each span is one pread; its reader copies the parts it
 * holds straight into their records. Spans go to the pool's threads and the waiting caller;
 * at most `qd` reads are in flight per job (the caller and qd - 1 threads).
 *
 * Errors are returned, never raised: a failed read (errno) or a short one (the file ends
 * before a needed byte: ES_IO_SHORT) marks the job; its records must not be used.
 * Threads start at the first job (and again in a forked child, whose pool has no threads), by
 * one caller at a time: the others wait until it is done (es_io_pool_start).
 */
#ifndef ENGRAM_IO_H
#define ENGRAM_IO_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ES_IO_PAGE 4096
#define ES_IO_MAX_PARTS 2
#define ES_IO_MAX_QD 256
#define ES_IO_SPAN_MAX (256 * 1024) /* a span (one read) never grows past this: bounded buffers */

typedef struct {
    int fd;               /* the file to read, or -1: the part is in memory at mem */
    const char *mem;      /* memory source when fd < 0 (e.g. scales held in RAM) */
    int64_t base;         /* offset of row 0 (in the file, or from mem) */
    int64_t bytes;        /* bytes of this part of a record */
    int64_t per_group;    /* records per group (1: a plain [N, bytes] tensor) */
    int64_t group_bytes;  /* bytes from one group to the next */
    int64_t dst_off;      /* where in the record this part goes */
    int64_t sums;         /* offset in a group of its records' checksums (8 bytes each), or -1: none */
    uint64_t seed;        /* row r's checksum is es_io_sum(record, seed + r) */
} es_io_part;

static inline int64_t es_io_off(const es_io_part *p, int64_t row) {
    return p->base + (row / p->per_group) * p->group_bytes + (row % p->per_group) * p->bytes;
}

/* The file offset of row r's checksum (p->sums >= 0). */
static inline int64_t es_io_sum_off(const es_io_part *p, int64_t row) {
    return p->base + (row / p->per_group) * p->group_bytes + p->sums + (row % p->per_group) * 8;
}

/* A file's stamp at open: (device, inode, size, mtime_ns, ctime_ns, nlink). It changed when its
 * device, inode, size or mtime differ, or its ctime does while its link count is the one at
 * open: a write with the mtime put back (utime) moves the ctime, which nobody can set. A link
 * added or removed moves the ctime too (a file renamed over the open one unlinks it: the safe
 * replacement, whose readers keep the old inode), so a link count that changed leaves the ctime
 * out (io/files.py's stamp_changed is the same rule). */
static inline int es_stamp_changed(const int64_t *s, const struct stat *st) {
    int64_t mt = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    int64_t ct = (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
    if ((int64_t)st->st_dev != s[0] || (int64_t)st->st_ino != s[1] || (int64_t)st->st_size != s[2] || mt != s[3])
        return 1;
    return ct != s[4] && (int64_t)st->st_nlink == s[5];
}

/* ---- record checksums: XXH64 (Yann Collet's xxHash, 64-bit), in portable C ------------------
 * Plain integer arithmetic on little-endian words: the same value on every CPU and compiler
 * (x86-64, aarch64, big-endian hosts swap), no ISA path to keep in step. About 1 ns per 32
 * bytes: a 264-byte record's sum costs ~30 ns against a cold 4 KiB read's tens of microseconds. */
#define ES_SUM_P1 0x9E3779B185EBCA87ULL
#define ES_SUM_P2 0xC2B2AE3D27D4EB4FULL
#define ES_SUM_P3 0x165667B19E3779F9ULL
#define ES_SUM_P4 0x85EBCA77C2B2AE63ULL
#define ES_SUM_P5 0x27D4EB2F165667C5ULL

static inline uint64_t es_sum_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t es_sum_le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t es_sum_le32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t es_sum_round(uint64_t acc, uint64_t in) {
    return es_sum_rotl(acc + in * ES_SUM_P2, 31) * ES_SUM_P1;
}

static inline uint64_t es_sum_merge(uint64_t h, uint64_t v) {
    return (h ^ es_sum_round(0, v)) * ES_SUM_P1 + ES_SUM_P4;
}

static inline uint64_t es_io_sum(const void *data, int64_t len, uint64_t seed) {
    const unsigned char *p = (const unsigned char *)data, *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + ES_SUM_P1 + ES_SUM_P2, v2 = seed + ES_SUM_P2, v3 = seed, v4 = seed - ES_SUM_P1;
        do { /* four independent lanes: their multiplies overlap */
            v1 = es_sum_round(v1, es_sum_le64(p));
            v2 = es_sum_round(v2, es_sum_le64(p + 8));
            v3 = es_sum_round(v3, es_sum_le64(p + 16));
            v4 = es_sum_round(v4, es_sum_le64(p + 24));
            p += 32;
        } while (end - p >= 32);
        h = es_sum_rotl(v1, 1) + es_sum_rotl(v2, 7) + es_sum_rotl(v3, 12) + es_sum_rotl(v4, 18);
        h = es_sum_merge(h, v1);
        h = es_sum_merge(h, v2);
        h = es_sum_merge(h, v3);
        h = es_sum_merge(h, v4);
    } else {
        h = seed + ES_SUM_P5;
    }
    h += (uint64_t)len;
    for (; end - p >= 8; p += 8) h = es_sum_rotl(h ^ es_sum_round(0, es_sum_le64(p)), 27) * ES_SUM_P1 + ES_SUM_P4;
    if (end - p >= 4) {
        h = es_sum_rotl(h ^ (uint64_t)es_sum_le32(p) * ES_SUM_P1, 23) * ES_SUM_P2 + ES_SUM_P3;
        p += 4;
    }
    for (; p < end; p++) h = es_sum_rotl(h ^ (uint64_t)(*p) * ES_SUM_P5, 11) * ES_SUM_P1;
    h ^= h >> 33;
    h *= ES_SUM_P2;
    h ^= h >> 29;
    h *= ES_SUM_P3;
    h ^= h >> 32;
    return h;
}

/* out[i] = the checksum of record i of recs[n] (stride bytes apart, len bytes each), row first + i. */
static inline void es_io_sums(const char *recs, int64_t n, int64_t stride, int64_t len, uint64_t seed,
                              int64_t first, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = es_io_sum(recs + i * stride, len, seed + (uint64_t)(first + i));
}

typedef struct {
    int32_t part;          /* which part */
    int64_t k0, k1;        /* the distinct rows [k0, k1) whose part this span holds */
    int64_t off, len;      /* page-aligned file range read by one pread */
    int64_t need;          /* bytes from off that must arrive (the last part's end) */
} es_io_span;

/* The spans of the distinct sorted rows u[m] (spans: room for m * nparts). Returns their count. */
static inline int64_t es_io_plan(const es_io_part *parts, int nparts, const int64_t *u, int64_t m,
                                 es_io_span *spans) {
    int64_t ns = 0;
    for (int p = 0; p < nparts; p++) {
        const es_io_part *pt = &parts[p];
        if (pt->fd < 0) continue;
        es_io_span *cur = NULL;
        for (int64_t k = 0; k < m; k++) {
            int64_t a = es_io_off(pt, u[k]), b = a + pt->bytes;
            if (pt->sums >= 0) { /* its checksum must arrive too (the same page in a page group) */
                int64_t sa = es_io_sum_off(pt, u[k]);
                if (sa < a) a = sa;
                if (sa + 8 > b) b = sa + 8;
            }
            int64_t pa = a & ~(int64_t)(ES_IO_PAGE - 1);
            int64_t pb = (b + ES_IO_PAGE - 1) & ~(int64_t)(ES_IO_PAGE - 1);
            /* same page as the span so far (rows ascend, so offsets do): extend it, unless the
             * read would pass ES_IO_SPAN_MAX (dense rows): then the shared page is read twice */
            if (cur && pa < cur->off + cur->len && pb - cur->off <= ES_IO_SPAN_MAX) {
                if (pb > cur->off + cur->len) cur->len = pb - cur->off;
                cur->k1 = k + 1;
                if (b - cur->off > cur->need) cur->need = b - cur->off;
                continue;
            }
            cur = &spans[ns++];
            cur->part = p;
            cur->k0 = k;
            cur->k1 = k + 1;
            cur->off = pa;
            cur->len = pb - pa;
            cur->need = b - pa;
        }
    }
    return ns;
}

/* Copy the in-memory parts of rows u[m] into their records (dst + k * stride). */
static inline void es_io_copy_mem(const es_io_part *parts, int nparts, const int64_t *u, int64_t m,
                                  char *dst, int64_t stride) {
    for (int p = 0; p < nparts; p++) {
        const es_io_part *pt = &parts[p];
        if (pt->fd >= 0) continue;
        for (int64_t k = 0; k < m; k++)
            memcpy(dst + k * stride + pt->dst_off, pt->mem + es_io_off(pt, u[k]), (size_t)pt->bytes);
    }
}

#define ES_IO_SHORT (-1)  /* a read that ended (end of file) before the bytes it needed */
#define ES_IO_BADSUM (-2) /* a record whose bytes do not match its checksum */

/* One span: read it into buf (ES_IO_SPAN_MAX bytes, page aligned), check and copy its rows'
 * parts out. Returns 0, an errno of pread, ES_IO_SHORT, or ES_IO_BADSUM (*bad: the row);
 * *got says how many bytes came. */
static inline int es_io_do_span(const es_io_part *parts, const int64_t *u, const es_io_span *s, char *buf,
                                char *dst, int64_t stride, int64_t *got, int64_t *bad) {
    const es_io_part *pt = &parts[s->part];
    int64_t n = 0;
    while (n < s->need) {
        ssize_t r = pread(pt->fd, buf + n, (size_t)(s->len - n), (off_t)(s->off + n));
        if (r < 0) {
            if (errno == EINTR) continue;
            *got = n;
            return errno ? errno : EIO;
        }
        if (r == 0) break; /* end of file */
        n += r;
    }
    *got = n;
    if (n < s->need) return ES_IO_SHORT;
    for (int64_t k = s->k0; k < s->k1; k++) {
        const char *rec = buf + (es_io_off(pt, u[k]) - s->off);
        if (pt->sums >= 0 && es_io_sum(rec, pt->bytes, pt->seed + (uint64_t)u[k])
                             != es_sum_le64((const unsigned char *)buf + (es_io_sum_off(pt, u[k]) - s->off))) {
            *bad = u[k];
            return ES_IO_BADSUM;
        }
        memcpy(dst + k * stride + pt->dst_off, rec, (size_t)pt->bytes);
    }
    return 0;
}

/* ---- jobs and the pool -------------------------------------------------------------------- */
typedef struct es_io_job {
    const es_io_part *parts;
    const int64_t *u;        /* distinct rows, sorted */
    const es_io_span *spans;
    int64_t nspans;
    char *dst;               /* record k at dst + k * stride */
    int64_t stride;
    int64_t next, done;      /* spans taken, spans finished (under the pool's lock) */
    int64_t inflight, max_inflight;   /* reads running now; the job's queue depth */
    int err;                 /* the first error: an errno, ES_IO_SHORT or ES_IO_BADSUM (0: none) */
    int64_t err_span, err_got, err_row;   /* err_row: the row of ES_IO_BADSUM */
    int64_t bytes;           /* bytes read */
    int queued;
    struct es_io_job *qnext;
} es_io_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t more;     /* a job has spans to take (or stop) */
    pthread_cond_t fin;      /* a span finished */
    es_io_job *head, *tail;  /* jobs with spans nobody took yet */
    int nthreads;            /* threads wanted (qd - 1) */
    int started, stop;
    int starting;            /* a caller is starting the threads (the lock is released while it waits) */
    pid_t pid;               /* the process whose threads these are (fork: start again) */
    pthread_t th[ES_IO_MAX_QD];
    char *bufs;              /* nthreads * ES_IO_SPAN_MAX, page aligned */
} es_io_pool;

/* The first queued job that may start another read (under mu). */
static inline es_io_job *es_io_pick(es_io_pool *pl) {
    for (es_io_job *j = pl->head; j; j = j->qnext)
        if (j->next < j->nspans && j->inflight < j->max_inflight) return j;
    return NULL;
}

static inline void es_io_unqueue(es_io_pool *pl, es_io_job *j) {
    es_io_job **pp = &pl->head, *prev = NULL;
    while (*pp && *pp != j) { prev = *pp; pp = &(*pp)->qnext; }
    if (!*pp) return;
    *pp = j->qnext;
    if (pl->tail == j) pl->tail = prev;
    j->qnext = NULL;
    j->queued = 0;
}

/* Take span s of job j, run it with buf, record the outcome (called with mu held; returns held). */
static inline void es_io_run_one(es_io_pool *pl, es_io_job *j, char *buf) {
    int64_t s = j->next++;
    j->inflight++;
    if (j->next == j->nspans) es_io_unqueue(pl, j);
    pthread_mutex_unlock(&pl->mu);
    int64_t got = 0, bad = -1;
    int e = j->err ? ECANCELED : es_io_do_span(j->parts, j->u, &j->spans[s], buf, j->dst, j->stride, &got, &bad);
    pthread_mutex_lock(&pl->mu);
    j->inflight--;
    if (e == 0) {
        j->bytes += got;
    } else if (!j->err) {
        j->err = e;
        j->err_span = s;
        j->err_got = got;
        j->err_row = bad;
    }
    if (++j->done == j->nspans) pthread_cond_broadcast(&pl->fin);
    else if (j->next < j->nspans) pthread_cond_signal(&pl->more); /* its queue depth has room again */
}

static void *es_io_worker(void *arg) {
    es_io_pool *pl = (es_io_pool *)arg;
    pthread_mutex_lock(&pl->mu);
    int me = pl->started; /* threads are started one at a time under mu */
    char *buf = pl->bufs + (int64_t)me * ES_IO_SPAN_MAX;
    pl->started++;
    pthread_cond_broadcast(&pl->fin);
    for (;;) {
        es_io_job *j;
        while (!pl->stop && (j = es_io_pick(pl)) == NULL) pthread_cond_wait(&pl->more, &pl->mu);
        if (pl->stop) break;
        es_io_run_one(pl, j, buf);
    }
    pthread_mutex_unlock(&pl->mu);
    return NULL;
}

/* A pool of qd - 1 threads (made at the first job). Returns 0 or an errno. */
static inline int es_io_pool_init(es_io_pool *pl, int qd) {
    memset(pl, 0, sizeof(*pl));
    if (qd < 1) qd = 1;
    if (qd > ES_IO_MAX_QD) qd = ES_IO_MAX_QD;
    pl->nthreads = qd - 1;
    if (pthread_mutex_init(&pl->mu, NULL)) return ENOMEM;
    if (pthread_cond_init(&pl->more, NULL) || pthread_cond_init(&pl->fin, NULL)) return ENOMEM;
    if (pl->nthreads) {
        void *p = NULL;
        if (posix_memalign(&p, ES_IO_PAGE, (size_t)pl->nthreads * ES_IO_SPAN_MAX)) return ENOMEM;
        pl->bufs = (char *)p;
    }
    pl->pid = getpid();
    return 0;
}

/* In a forked child: the pool's copy has no threads, and its lock and queue may be mid-use by
 * a thread that does not exist here. Start over (called before taking the lock). */
static inline void es_io_pool_afterfork(es_io_pool *pl) {
    pid_t now = getpid();
    if (pl->pid == now) return;
    pl->pid = now;
    pl->started = 0;
    pl->starting = 0;
    pl->head = pl->tail = NULL;
    pthread_mutex_init(&pl->mu, NULL);
    pthread_cond_init(&pl->more, NULL);
    pthread_cond_init(&pl->fin, NULL);
}

/* Start the threads this process lacks (at the first job). Under mu. It waits for each thread
 * with mu released, so a second caller arriving then waits for the first to finish instead of
 * starting threads of its own (two starters would hand two threads one slot and buffer). */
static inline void es_io_pool_start(es_io_pool *pl) {
    while (pl->starting) pthread_cond_wait(&pl->fin, &pl->mu);
    if (pl->started >= pl->nthreads || pl->stop) return;
    pl->starting = 1;
    while (pl->started < pl->nthreads && !pl->stop) {
        int want = pl->started + 1;
        if (pthread_create(&pl->th[pl->started], NULL, es_io_worker, pl) != 0) {
            pl->nthreads = pl->started; /* fewer threads: the caller reads what they would have */
            break;
        }
        while (pl->started < want) pthread_cond_wait(&pl->fin, &pl->mu);
    }
    pl->starting = 0;
    pthread_cond_broadcast(&pl->fin);
}

/* Stop and join the threads (no job may be pending). */
static inline void es_io_pool_free(es_io_pool *pl) {
    if (pl->pid == getpid()) {
        pthread_mutex_lock(&pl->mu);
        pl->stop = 1;
        pthread_cond_broadcast(&pl->more);
        int n = pl->started;
        pthread_mutex_unlock(&pl->mu);
        for (int i = 0; i < n; i++) pthread_join(pl->th[i], NULL);
    }
    free(pl->bufs);
    pl->bufs = NULL;
}

/* Queue a job of nspans spans (records of parts read into dst); threads start on it at once.
 * qd: the most reads of this job in flight at a time. */
static inline void es_io_submit(es_io_pool *pl, es_io_job *j, const es_io_part *parts, const int64_t *u,
                                const es_io_span *spans, int64_t nspans, char *dst, int64_t stride, int qd) {
    j->parts = parts;
    j->u = u;
    j->spans = spans;
    j->nspans = nspans;
    j->dst = dst;
    j->stride = stride;
    j->next = j->done = j->inflight = j->bytes = 0;
    j->max_inflight = qd < 1 ? 1 : qd;
    j->err = 0;
    j->err_span = j->err_got = j->err_row = -1;
    j->qnext = NULL;
    j->queued = 0;
    if (nspans == 0) return;
    es_io_pool_afterfork(pl);
    pthread_mutex_lock(&pl->mu);
    es_io_pool_start(pl);
    j->queued = 1;
    if (pl->tail) pl->tail->qnext = j; else pl->head = j;
    pl->tail = j;
    pthread_cond_broadcast(&pl->more);
    pthread_mutex_unlock(&pl->mu);
}

/* Wait until every span of j is done, reading spans nobody took yet with buf (the caller's
 * ES_IO_SPAN_MAX page-aligned bytes). Returns j->err (0: every record is whole). */
static inline int es_io_wait(es_io_pool *pl, es_io_job *j, char *buf) {
    if (j->nspans == 0) return 0;
    pthread_mutex_lock(&pl->mu);
    while (j->done < j->nspans) {
        if (j->next < j->nspans && j->inflight < j->max_inflight) es_io_run_one(pl, j, buf);
        else pthread_cond_wait(&pl->fin, &pl->mu);
    }
    if (j->queued) es_io_unqueue(pl, j);
    int e = j->err;
    pthread_mutex_unlock(&pl->mu);
    return e;
}

/* ---- distinct rows ------------------------------------------------------------------------ */
static int es_io_cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* u = the distinct values of rows[n], sorted (u: room for n). Returns their count. */
static inline int64_t es_io_unique(const int64_t *rows, int64_t n, int64_t *u) {
    if (n == 0) return 0;
    if (u != rows) memcpy(u, rows, (size_t)n * sizeof(int64_t));
    qsort(u, (size_t)n, sizeof(int64_t), es_io_cmp64);
    int64_t m = 1;
    for (int64_t i = 1; i < n; i++)
        if (u[i] != u[m - 1]) u[m++] = u[i];
    return m;
}

/* The index of r in the sorted distinct u[m], or -1. */
static inline int64_t es_io_find(const int64_t *u, int64_t m, int64_t r) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        if (u[mid] < r) lo = mid + 1; else hi = mid;
    }
    return (lo < m && u[lo] == r) ? lo : -1;
}

static inline double es_io_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* ENGRAM_IO_H */
