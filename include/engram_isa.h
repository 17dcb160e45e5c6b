/* engram_isa.h: which instruction set the kernels run, chosen once at import.
 *
 * Every hot kernel is compiled once per path from one template (engram_step_kern.h,
 * engram_fp8_kern.h, engram_hash_kern.h), each copy with its own __attribute__((target(...))):
 *   ES_ISA_BASELINE  plain C + GCC vector extensions, any CPU (x86-64 SSE2, aarch64 NEON, ...)
 *   ES_ISA_AVX2      AVX2 + FMA + F16C (x86-64-v3)
 *   ES_ISA_AVX512    AVX-512 F/BW/VL/DQ (64-byte vectors) + the above
 *   ES_ISA_NEON      aarch64 ASIMD (every ARMv8-A CPU): arm_neon.h widenings (FCVTL), tiles
 *                    sized for its 32 vector registers; the aarch64 builds' second copy
 *   ES_ISA_BF16      the above + AVX512_BF16 and VBMI: the V4.1 float8 projection, and the GEMM of
 *                    bf16 weights on bf16 rows (es_gemm_range_dp, engram_step.h), multiply with
 *                    vdpbf16ps (engram_fp8.h); every other kernel runs its avx512 copy
 *   ES_ISA_NEON_BF16 neon + FEAT_BF16 (HWCAP2_BF16): the GEMM of bf16 weights on bf16 rows on BFDOT
 *                    (es_gemm_range_bfdot, engram_bfdot.h); every other kernel runs its neon copy
 * A copy is made by setting ES_PATH to the level and including the template: engram_path.h
 * turns the level into what every template shares (the names' suffix through ES_SF, the target
 * attribute, the vector width, F16C, NEON), and each header's block for the path sets only its
 * template's own parameters (tile sizes, ...).
 * A public kernel name (es_gemm_range, es_hash_window, ...) runs the copy es_isa_now(), the one
 * runtime's level (below), selects: ES_DISPATCH, or ES_ON_PATH where a level runs another
 * path's copy or code of its own (the dispatch section at the end). So the environment
 * (ENGRAM_STREAM_ISA), the tests and the measured choice (engine/tune.py) can run any path the
 * CPU supports.
 * target_clones is not used: it cannot be forced, and needs glibc's ifunc (not musl).
 * The x86 copies exist only where the compiler has target attributes (GCC, clang) on
 * x86-64; elsewhere there is one copy, the baseline.
 */
#ifndef ENGRAM_ISA_H
#define ENGRAM_ISA_H

#include <stdint.h>

#define ES_ISA_BASELINE 0
#define ES_ISA_AVX2 1
#define ES_ISA_AVX512 2
#define ES_ISA_BF16 3
#define ES_ISA_NEON 4
#define ES_ISA_NEON_BF16 5

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(ES_NO_X86_PATHS)
#define ES_X86_PATHS 1
#include <cpuid.h>
#define ES_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ES_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define ES_TARGET_BF16 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,avx2,fma,f16c")))
#else
#define ES_X86_PATHS 0
#endif
/* The neon copy: aarch64 with GCC or clang (ASIMD is part of ARMv8-A; getauxval(AT_HWCAP) says
 * whether the OS runs it, as the x86 builtins check XCR0). */
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(ES_NO_NEON_PATHS)
#include <arm_neon.h>
#include <sys/auxv.h>
#define ES_NEON_PATHS 1
#if defined(__clang__) /* ASIMD is in every AArch64 target's default features; clang's target() syntax varies */
#define ES_TARGET_NEON
#else
#define ES_TARGET_NEON __attribute__((target("+simd")))
#endif
/* BFDOT's functions alone (engram_bfdot.h): the build's baseline stays ARMv8.0-A */
#define ES_TARGET_NEON_BF16 __attribute__((target("arch=armv8.2-a+bf16")))
#else
#define ES_NEON_PATHS 0
#endif

/* The CPU features the paths need, as bits (es_isa_best_of takes them: testable on any CPU). */
#define ES_CPU_AVX2 1
#define ES_CPU_FMA 2
#define ES_CPU_F16C 4
#define ES_CPU_AVX512 8 /* F, BW, VL and DQ together */
#define ES_CPU_BF16 16  /* AVX512_BF16 and VBMI (the bf16 path's vdpbf16ps and vpermt2b) */

/* The best level a CPU with `feats` runs: the AVX2 copies use F16C too (bfloat16/half converts). */
static inline int es_isa_best_of(int feats) {
#if ES_X86_PATHS
    int v3 = ES_CPU_AVX2 | ES_CPU_FMA | ES_CPU_F16C;
    if ((feats & (v3 | ES_CPU_AVX512 | ES_CPU_BF16)) == (v3 | ES_CPU_AVX512 | ES_CPU_BF16)) return ES_ISA_BF16;
    if ((feats & (v3 | ES_CPU_AVX512)) == (v3 | ES_CPU_AVX512)) return ES_ISA_AVX512;
    if ((feats & v3) == v3) return ES_ISA_AVX2;
#endif
    (void)feats;
    return ES_ISA_BASELINE;
}

/* The best level this CPU (and OS: the builtins check XCR0 for the AVX states) runs. */
static inline int es_isa_cpu_best(void) {
    static int best = -1; /* the CPU does not change under a process: cpuid once (a VM traps it) */
    int known = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (known >= 0) return known;
    int feats = 0;
#if ES_X86_PATHS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) feats |= ES_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) feats |= ES_CPU_FMA;
    unsigned a, b, c, d; /* F16C: CPUID.1:ECX bit 29 (clang's builtin does not know "f16c") */
    if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29))) feats |= ES_CPU_F16C;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        feats |= ES_CPU_AVX512;
    if (__builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16")) feats |= ES_CPU_BF16;
#endif
#if ES_NEON_PATHS
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
    if (getauxval(AT_HWCAP) & HWCAP_ASIMD)
        known = getauxval(AT_HWCAP2) & HWCAP2_BF16 ? ES_ISA_NEON_BF16 : ES_ISA_NEON;
#endif
    if (known < 0) known = es_isa_best_of(feats);
    __atomic_store_n(&best, known, __ATOMIC_RELAXED);
    return known;
}

/* Whether this CPU and build run `level`: the baseline, and the levels of this architecture up
 * to the best (the neon levels are above the x86 ones in number only). */
static inline int es_isa_runs(int level) {
    const int best = es_isa_cpu_best();
    if (level == ES_ISA_BASELINE || level == best) return 1;
    if (best >= ES_ISA_NEON) return level >= ES_ISA_NEON && level < best;
    return level > ES_ISA_BASELINE && level < best;
}

/* ---- the kernel runtime: one per process, owned by engram_stream._hash ----------------
 * Every extension compiles these headers, but the path and the worker teams live in one place:
 * _hash.pyx hands its es_runtime_own (engram_runtime.h; es_runtime_of_process() in _hash.pxd,
 * exported through the module's capsule table) to every other extension at its import
 * (es_runtime_bind), so one store switches every extension's kernels, every team comes from one
 * set of slots and a thread keeps one team, and no copy is kept in step by hand. Until bound (in
 * _hash itself) a translation unit runs its own es_own_* functions.
 *   the process's path   es_isa_set: the best this CPU runs until engine/isa.py chooses
 *   a call's path        es_isa_call(level) on the calling thread (-1: the process's again):
 *                        an engine running one operation on the path measured fastest for it
 *                        (engine/tune.py); a team's workers take the caller's (es_team_run)
 *   forced               es_isa_force(1): ENGRAM_STREAM_ISA or use_isa; a call's path is then
 *                        ignored, so the tests and the environment hold every kernel to one.
 *   the teams            es_team_open / _close / _keep / _put / _slots_held (engram_team.h).
 * Adding a path touches the levels above, es_isa_runs, engram_path.h (its settings), ES_ON_PATH
 * (then every dispatch, which must say what the path runs) and each header's per-path blocks. */
struct es_team_s;
typedef struct es_runtime {
    int (*isa_now)(void);
    int (*isa_set)(int level);
    void (*isa_call)(int level);
    void (*isa_force)(int on);
    int (*isa_forced)(void);
    struct es_team_s *(*team_open)(int nthreads, int64_t spin_ns);
    void (*team_close)(struct es_team_s *t);
    struct es_team_s *(*team_keep)(int nthreads, int64_t spin_ns);
    void (*team_put)(struct es_team_s *t);
    int (*team_slots_held)(void);
} es_runtime;

static int es_isa_process = -1;     /* -1 until set: the first dispatch takes the CPU's best */
static int es_isa_is_forced = 0;
static __thread int es_isa_thread = -1;

static int es_own_isa_now(void) {
    const int t = es_isa_thread;
    if (t >= 0 && !__atomic_load_n(&es_isa_is_forced, __ATOMIC_RELAXED)) return t;
    int p = __atomic_load_n(&es_isa_process, __ATOMIC_RELAXED);
    if (p < 0) __atomic_store_n(&es_isa_process, p = es_isa_cpu_best(), __ATOMIC_RELAXED);
    return p;
}
static int es_own_isa_set(int level) {
    if (!es_isa_runs(level)) return -1;
    __atomic_store_n(&es_isa_process, level, __ATOMIC_RELAXED);
    return 0;
}
static void es_own_isa_call(int level) { es_isa_thread = level >= 0 && es_isa_runs(level) ? level : -1; }
static void es_own_isa_force(int on) { __atomic_store_n(&es_isa_is_forced, on != 0, __ATOMIC_RELAXED); }
static int es_own_isa_forced(void) { return __atomic_load_n(&es_isa_is_forced, __ATOMIC_RELAXED); }

/* This extension's view of the runtime: NULL (its own functions) until es_runtime_bind. */
static const es_runtime *es_rt;
static inline void es_runtime_bind(const es_runtime *rt) { es_rt = rt; }

/* The level the calling thread's kernels run. */
static inline int es_isa_now(void) { return es_rt ? es_rt->isa_now() : es_own_isa_now(); }
/* The process's level; refused (-1, nothing changes) where the CPU or this build does not run it. */
static inline int es_isa_set(int level) { return es_rt ? es_rt->isa_set(level) : es_own_isa_set(level); }
static inline void es_isa_call(int level) { if (es_rt) es_rt->isa_call(level); else es_own_isa_call(level); }
static inline void es_isa_force(int on) { if (es_rt) es_rt->isa_force(on); else es_own_isa_force(on); }
static inline int es_isa_forced(void) { return es_rt ? es_rt->isa_forced() : es_own_isa_forced(); }

/* The horizontal sum of every path's vectors (es_hsum, es8_hsum): w (a power of two) lanes in
 * t, halves folded onto halves, so each path sums its lanes in one order. */
static inline __attribute__((always_inline)) float es_hsum_lanes(float *t, int w) {
#pragma GCC unroll 4
    for (w /= 2; w >= 1; w /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* ---- dispatch: what each level runs, in one form ----------------------------------------
 * ES_ON_PATH(level, baseline, avx2, avx512, bf16, neon): run the statement (an expression) given
 * for `level`. Only this build's levels are compiled: the x86 ones in x86 builds, neon in
 * aarch64 ones (neon_bf16 runs neon's: its one kernel of its own, the BFDOT GEMM, is chosen by
 * es_gemm_mode), elsewhere the baseline alone (level not read); a level this build does not
 * have runs the baseline. Every dispatch names every level, so a level added here is an error
 * at each dispatch until it says what that level runs.
 * ES_DISPATCH_COPIES(level, name, args, baseline, avx2, avx512, bf16, neon): call name_<copy>
 * args, the copy (a suffix) named for `level`.
 * ES_DISPATCH(name, args): the copy of the path es_isa_now() selects (name_baseline,
 * name_avx2, name_avx512; name_neon; bf16: the avx512 copy, the kernels with a bf16 copy of
 * their own naming it with ES_DISPATCH_COPIES or ES_ON_PATH). */
#if ES_X86_PATHS
#define ES_ON_PATH(level, baseline, avx2, avx512, bf16, neon) \
    do {                                                      \
        switch (level) {                                      \
            case ES_ISA_BF16: bf16; break;                    \
            case ES_ISA_AVX512: avx512; break;                \
            case ES_ISA_AVX2: avx2; break;                    \
            default: baseline; break;                         \
        }                                                     \
    } while (0)
#elif ES_NEON_PATHS
#define ES_ON_PATH(level, baseline, avx2, avx512, bf16, neon) \
    do {                                                      \
        if ((level) >= ES_ISA_NEON) neon;                     \
        else baseline;                                        \
    } while (0)
#else
#define ES_ON_PATH(level, baseline, avx2, avx512, bf16, neon) \
    do {                                                      \
        baseline;                                             \
    } while (0)
#endif
#define ES_DISPATCH_COPIES(level, name, args, baseline, avx2, avx512, bf16, neon)                          \
    ES_ON_PATH(level, name##_##baseline args, name##_##avx2 args, name##_##avx512 args, name##_##bf16 args, \
               name##_##neon args)
#define ES_DISPATCH(name, args) ES_DISPATCH_COPIES(es_isa_now(), name, args, baseline, avx2, avx512, avx512, neon)

#endif /* ENGRAM_ISA_H */
