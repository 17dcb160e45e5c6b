/* engram_team.h: the threads a call's work splits over, shared by every engine's kernels
 * (engram_step.h, engram_fp8.h).
 *
 *   es_team_open/_close   a caller's team of workers; es_team_run hands them one split
 *   es_team_keep/_put     a calling thread's team kept across calls
 *   es_parallel_pieces    one split over a team of one call; es_parallel: at most nthreads pieces
 *   es_split              a split over a team the caller holds, or one of its own
 *
 * The runtime (engram_isa.h's es_rt) owns the slots when one is bound: every extension module
 * then shares the process's teams. Nothing here allocates or raises.
 */
#ifndef ENGRAM_TEAM_H
#define ENGRAM_TEAM_H

#include <stdint.h>
#include <pthread.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "engram_isa.h"

/* ---- work over threads -------------------------------------------------------------
 * A team is the workers of a caller (its calls' splits): es_team_open starts nthreads - 1
 * threads, es_team_run hands every one of them a split, fn(ctx, i0, i1) over [0, n) in pieces
 * of `grain` items taken in turn from a shared counter by the caller and the workers present,
 * and es_team_close lets them go. A calling thread keeps its team across calls (es_team_keep
 * below), so a thread's start (15-25 us on a 2-vCPU VM, bench/NOTES.md) is off every split and
 * every call but its first, and the caller's work before its first split overlaps the wake-up.
 * Taking pieces, not fixed halves, keeps a split no slower than one thread when a worker gets
 * no core (a shared machine): the others take its pieces. es_team_run returns once every piece
 * taken is done: it waits for the workers inside the split, never for one that has not started
 * or is between splits. Between splits a worker spins the team's spin_ns, then sleeps until the
 * next split or the close, and at a split's end the caller spins as long for the workers still
 * in it (a wake-up costs 10-30 us on a VM; a call's team: ES_TEAM_SPIN_NS); after the close a
 * worker exits (a thread that starts late finds the team closed and exits). Nothing is
 * allocated (the teams live in static slots; a thread that cannot start, or no free slot: the
 * caller takes every piece), and work split into independent items gives results bitwise equal
 * to one thread, whoever computes a piece.
 * es_parallel_pieces: a team of one split, with no spin (nothing follows the split, and on the
 * 2-vCPU Zen 5 a caller spinning 200 us for the other half of a 4 ms GEMV made it 5.2-5.5 ms
 * against 4.0-4.8 when it sleeps: the spin costs the other core more than a wake-up costs).
 * es_parallel: the same in at most nthreads contiguous pieces (fn is called at most nthreads
 * times: a caller may hand each call its own scratch). */
#define ES_MAX_THREADS 16
#define ES_TEAM_SPIN_NS 200000

typedef void (*es_range_fn)(void *ctx, int64_t i0, int64_t i1);
typedef struct es_team_s {
    pthread_mutex_t mu;
    pthread_cond_t posted; /* a split was posted, or the team closed */
    pthread_cond_t idle;   /* active fell to 0 */
    es_range_fn fn;        /* the current split (written under mu before seq moves) */
    void *ctx;
    int64_t n, grain;
    int64_t next;          /* the first item of the split no one has taken (atomic) */
    unsigned seq;          /* splits posted (under mu; spinners read it atomically) */
    unsigned shut;         /* the last split whose pieces were all taken (under mu) */
    int closed;            /* (under mu; spinners read it atomically) */
    int parked;            /* between calls of a kept team: workers sleep, not spin (under mu; atomic) */
    int active;            /* workers inside the current split (changed under mu; atomic) */
    int sleepers;          /* workers waiting on posted (under mu) */
    int nthreads;
    int isa;               /* the caller's kernel path for the current split (es_isa_call in each worker) */
    int64_t spin_ns;       /* how long a worker between splits, and the caller at a split's end, spin */
    int refs;              /* the caller and the started workers not yet gone (atomic): the last frees */
    int used;              /* the slot is taken (atomic) */
} es_team;

/* The teams in flight, a fixed set of the process (the runtime's, engram_isa.h): a call takes no memory, and a call
 * that finds every slot held runs on the caller alone. (A forked child keeps the slots its
 * parent's late workers held: at most this many calls there run on one thread.) */
#define ES_TEAM_SLOTS 64
static es_team es_team_slots[ES_TEAM_SLOTS] __attribute__((unused));

/* The slots held now: by a call's team, or by its workers still on their way out. */
static int es_own_team_slots_held(void) {
    int k = 0;
    for (int i = 0; i < ES_TEAM_SLOTS; i++) k += __atomic_load_n(&es_team_slots[i].used, __ATOMIC_ACQUIRE);
    return k;
}

static inline void es_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t es_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One turn of a bounded spin: 0 once `until` (es_now_ns) has passed, checked every 64 turns. */
static inline int es_spin_turn(int *turn, int64_t until) {
    if ((++*turn & 63) == 0 && es_now_ns() > until) return 0;
    es_cpu_relax();
    return 1;
}

static void es_team_take(es_team *t) {
    for (;;) {
        const int64_t i0 = __atomic_fetch_add(&t->next, t->grain, __ATOMIC_RELAXED);
        if (i0 >= t->n) return;
        t->fn(t->ctx, i0, i0 + t->grain < t->n ? i0 + t->grain : t->n);
    }
}

static void es_team_release(es_team *t) {
    if (__atomic_sub_fetch(&t->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_cond_destroy(&t->idle);
        pthread_cond_destroy(&t->posted);
        pthread_mutex_destroy(&t->mu);
        __atomic_store_n(&t->used, 0, __ATOMIC_RELEASE);
    }
}

/* A worker: it joins each split under mu (so it reads the split's fields the caller wrote
 * under mu, and the caller's wait counts it), takes pieces, leaves; between splits it spins,
 * then sleeps. */
static void *es_team_worker(void *arg) {
    es_team *t = (es_team *)arg;
    unsigned seen = 0;
#ifdef __linux__
    prctl(PR_SET_NAME, "engram-worker", 0, 0, 0); /* what top -H and /proc/<pid>/task/<tid>/comm show */
#endif
    pthread_mutex_lock(&t->mu);
    while (!t->closed) {
        if (t->seq == seen) {
            pthread_mutex_unlock(&t->mu);
            const int64_t until = es_now_ns() + t->spin_ns;
            int turn = 0;
            while (__atomic_load_n(&t->seq, __ATOMIC_RELAXED) == seen && !__atomic_load_n(&t->closed, __ATOMIC_RELAXED)
                   && !__atomic_load_n(&t->parked, __ATOMIC_RELAXED) && es_spin_turn(&turn, until)) {}
            pthread_mutex_lock(&t->mu);
            if (!t->closed && t->seq == seen) {
                t->sleepers++;
                pthread_cond_wait(&t->posted, &t->mu);
                t->sleepers--;
            }
            continue;
        }
        seen = t->seq;
        if (t->shut == seen) continue; /* every piece taken: wait for the next split */
        __atomic_add_fetch(&t->active, 1, __ATOMIC_RELAXED);
        es_isa_call(t->isa);
        pthread_mutex_unlock(&t->mu);
        es_team_take(t);
        pthread_mutex_lock(&t->mu); /* (release: the caller that reads active 0 sees the pieces) */
        if (__atomic_sub_fetch(&t->active, 1, __ATOMIC_ACQ_REL) == 0) pthread_cond_signal(&t->idle);
    }
    pthread_mutex_unlock(&t->mu);
    es_team_release(t);
    return 0;
}

/* NULL (the caller alone) for nthreads <= 1 or no free slot. */
static es_team *es_own_team_open(int nthreads, int64_t spin_ns) {
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads <= 1) return 0;
    es_team *t = 0;
    for (int i = 0; i < ES_TEAM_SLOTS && !t; i++) {
        int z = 0;
        if (__atomic_compare_exchange_n(&es_team_slots[i].used, &z, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            t = &es_team_slots[i];
    }
    if (!t) return 0;
    pthread_mutex_init(&t->mu, 0);
    pthread_cond_init(&t->posted, 0);
    pthread_cond_init(&t->idle, 0);
    t->fn = 0, t->ctx = 0, t->n = 0, t->grain = 1, t->next = 0, t->seq = 0, t->shut = 0, t->closed = 0, t->active = 0;
    t->parked = 0, t->isa = -1;
    t->sleepers = 0, t->nthreads = nthreads, t->spin_ns = spin_ns, t->refs = nthreads;
    pthread_attr_t attr;
    const int detach = pthread_attr_init(&attr) == 0;
    if (detach) pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 1; i < nthreads; i++) {
        pthread_t tid;
        if (!detach || pthread_create(&tid, &attr, es_team_worker, t) != 0) es_team_release(t);
    }
    if (detach) pthread_attr_destroy(&attr);
    return t;
}

/* grain <= 0: about 4 pieces a thread. */
static inline int64_t es_grain(int nthreads, int64_t n, int64_t grain) {
    if (grain <= 0) grain = (n + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)nthreads);
    return grain < 1 ? 1 : grain;
}

/* One split on the team (NULL: on the caller). nthreads: the threads this split is worth
 * (<= 1: the caller alone, the workers keep waiting); grain as es_grain. Once the caller finds
 * the counter spent it shuts the split (shut = seq, under mu): a worker that comes later does
 * not join it, so none is still taking when the next split rewrites fn, ctx and the counter. */
static inline void es_team_run(es_team *t, int nthreads, int64_t n, int64_t grain, es_range_fn fn, void *ctx) {
    if (t && nthreads > t->nthreads) nthreads = t->nthreads;
    if (nthreads < 1) nthreads = 1;
    grain = es_grain(nthreads, n, grain);
    if (!t || nthreads <= 1 || n <= grain) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&t->mu);
    t->fn = fn, t->ctx = ctx, t->n = n, t->grain = grain, t->isa = es_isa_now();
    __atomic_store_n(&t->next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&t->seq, t->seq + 1, __ATOMIC_RELAXED);
    if (t->sleepers) pthread_cond_broadcast(&t->posted);
    pthread_mutex_unlock(&t->mu);
    es_team_take(t);
    pthread_mutex_lock(&t->mu);
    t->shut = t->seq;
    pthread_mutex_unlock(&t->mu);
    /* the workers inside it end their last piece about when the caller does: spin for them
     * first (spin_ns), then sleep */
    const int64_t until = es_now_ns() + t->spin_ns;
    int turn = 0;
    while (__atomic_load_n(&t->active, __ATOMIC_ACQUIRE) > 0 && es_spin_turn(&turn, until)) {}
    if (__atomic_load_n(&t->active, __ATOMIC_ACQUIRE) > 0) {
        pthread_mutex_lock(&t->mu);
        while (__atomic_load_n(&t->active, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&t->idle, &t->mu);
        pthread_mutex_unlock(&t->mu);
    }
}

static void es_own_team_close(es_team *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    __atomic_store_n(&t->closed, 1, __ATOMIC_RELAXED);
    if (t->sleepers) pthread_cond_broadcast(&t->posted);
    pthread_mutex_unlock(&t->mu);
    es_team_release(t);
}

/* ---- a calling thread's kept team ------------------------------------------------
 * A worker's start costs its caller ~20 us (pthread_create on the 2-vCPU VM: clone and the
 * signal masks around it), 4% of a 16-stream step. So the workers a thread's calls use are
 * kept: es_team_keep gives the calling thread its team (started by its first call that
 * splits, again when the thread count changes), woken for the call (a futex wake; they start
 * spinning while the caller hashes), and es_team_put parks it at the call's end: its workers
 * sleep between calls, taking no CPU from what the caller runs next. A thread's team is closed
 * when the thread exits (a key destructor) and forgotten in a forked child (which has none of
 * its workers; the slot stays held there). A call made while the thread's team is in use (a
 * nested one) gets a team of its own, closed by its es_team_put. */
static __thread es_team *es_kept_team;
static __thread int es_kept_busy;
static pthread_key_t es_kept_key;
static pthread_once_t es_kept_once = PTHREAD_ONCE_INIT;
static int es_kept_ok;

static void es_kept_exit(void *t) { es_own_team_close((es_team *)t); } /* the thread is leaving */
static void es_kept_forget(void) { /* a forked child */
    es_kept_team = 0, es_kept_busy = 0;
    pthread_setspecific(es_kept_key, 0); /* so its exit does not close the parent's team */
}
static void es_kept_init(void) {
    es_kept_ok = pthread_key_create(&es_kept_key, es_kept_exit) == 0 && pthread_atfork(0, 0, es_kept_forget) == 0;
}

static inline void es_team_park(es_team *t, int parked) {
    pthread_mutex_lock(&t->mu);
    __atomic_store_n(&t->parked, parked, __ATOMIC_RELAXED);
    if (!parked && t->sleepers) pthread_cond_broadcast(&t->posted);
    pthread_mutex_unlock(&t->mu);
}

/* NULL (the caller alone) as es_team_open. */
static es_team *es_own_team_keep(int nthreads, int64_t spin_ns) {
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads <= 1) return 0;
    pthread_once(&es_kept_once, es_kept_init);
    if (!es_kept_ok || es_kept_busy) return es_own_team_open(nthreads, spin_ns);
    es_team *t = es_kept_team;
    if (t && (t->nthreads != nthreads || t->spin_ns != spin_ns)) {
        es_own_team_close(t); /* (its slot may go to another thread now: the key forgets it too) */
        es_kept_team = t = 0;
        pthread_setspecific(es_kept_key, 0);
    }
    if (t) {
        es_team_park(t, 0);
    } else {
        if (!(t = es_own_team_open(nthreads, spin_ns))) return 0;
        if (pthread_setspecific(es_kept_key, t) != 0) return t; /* kept nowhere: es_team_put closes it */
        es_kept_team = t;
    }
    es_kept_busy = 1;
    return t;
}

static void es_own_team_put(es_team *t) {
    if (!t) return;
    if (t == es_kept_team) {
        es_team_park(t, 1);
        es_kept_busy = 0;
    } else {
        es_own_team_close(t);
    }
}

/* The runtime's teams (engram_isa.h): the owner's once bound, so every extension draws on one
 * set of slots and a thread keeps one team whichever extension's call takes it. */
static inline es_team *es_team_open(int nthreads, int64_t spin_ns) {
    return es_rt ? es_rt->team_open(nthreads, spin_ns) : es_own_team_open(nthreads, spin_ns);
}
static inline void es_team_close(es_team *t) {
    if (es_rt) es_rt->team_close(t);
    else es_own_team_close(t);
}
static inline es_team *es_team_keep(int nthreads, int64_t spin_ns) {
    return es_rt ? es_rt->team_keep(nthreads, spin_ns) : es_own_team_keep(nthreads, spin_ns);
}
static inline void es_team_put(es_team *t) {
    if (es_rt) es_rt->team_put(t);
    else es_own_team_put(t);
}
static inline int es_team_slots_held(void) { return es_rt ? es_rt->team_slots_held() : es_own_team_slots_held(); }

static inline void es_parallel_pieces(int nthreads, int64_t n, int64_t grain, es_range_fn fn, void *ctx) {
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads < 1) nthreads = 1;
    grain = es_grain(nthreads, n, grain);
    if (nthreads > (n + grain - 1) / grain) nthreads = (int)((n + grain - 1) / grain);
    es_team *t = es_team_open(nthreads, 0);
    es_team_run(t, nthreads, n, grain, fn, ctx);
    es_team_close(t);
}

/* A split on the call's team when it has one, else on threads of its own. */
static inline void es_split(es_team *team, int nthreads, int64_t n, int64_t grain, es_range_fn fn, void *ctx) {
    if (team) es_team_run(team, nthreads, n, grain, fn, ctx);
    else es_parallel_pieces(nthreads, n, grain, fn, ctx);
}

static inline void es_parallel(int nthreads, int64_t n, es_range_fn fn, void *ctx) {
    if (nthreads > ES_MAX_THREADS) nthreads = ES_MAX_THREADS;
    if (nthreads < 1) nthreads = 1;
    es_parallel_pieces(nthreads, n, (n + nthreads - 1) / nthreads, fn, ctx);
}

#endif /* ENGRAM_TEAM_H */
