/* engram_path.h: the settings every kernel template shares for one path, chosen by ES_PATH.
 *
 * A kernel template (engram_step_kern.h, engram_fp8_kern.h, engram_hash_kern.h; the 512-bit
 * engram_fp8_tiles.h) is compiled once per path (engram_isa.h): its header sets ES_PATH to an
 * ES_ISA_* level and the template's own parameters (tile sizes, ...), then includes the
 * template, which opens with this header and closes with engram_path_end.h (that undefines what
 * is set here, and ES_PATH). From ES_PATH:
 *   ES_SFX       the suffix of the copy's names: baseline, avx2, avx512, bf16, neon
 *   ES_TGT       its target attribute (empty for the baseline)
 *   ES_VW        floats per vector: 4 (16 bytes: SSE2 / NEON registers; wider generic vectors
 *                spill there), 8 (AVX2), 16 (AVX-512, bf16)
 *   ES_F16C      1 where F16C converts half floats (the x86 copies), else 0
 *   ES_NEON      1 in the aarch64 ASIMD copy (FCVTL converts half floats), else 0
 *   ES_SF(name)  name_<ES_SFX>: this copy's function, type or constant `name`
 *   ES_KI        a helper inlined into this copy's kernels (static, always_inline, the target)
 * The bf16 level has a copy of engram_fp8_tiles.h only; its other kernels are written out in
 * engram_fp8.h, and it runs the avx512 copies of the other templates (ES_DISPATCH).
 * No include guard: each copy includes it again.
 */
#ifndef ES_PATH
#error "engram_path.h: define ES_PATH (an ES_ISA_* level of engram_isa.h) before including a kernel template"
#endif
#if ES_PATH == ES_ISA_BASELINE
#define ES_SFX baseline
#define ES_TGT
#define ES_VW 4
#define ES_F16C 0
#define ES_NEON 0
#elif ES_PATH == ES_ISA_AVX2 && ES_X86_PATHS
#define ES_SFX avx2
#define ES_TGT ES_TARGET_AVX2
#define ES_VW 8
#define ES_F16C 1
#define ES_NEON 0
#elif ES_PATH == ES_ISA_AVX512 && ES_X86_PATHS
#define ES_SFX avx512
#define ES_TGT ES_TARGET_AVX512
#define ES_VW 16
#define ES_F16C 1
#define ES_NEON 0
#elif ES_PATH == ES_ISA_BF16 && ES_X86_PATHS
#define ES_SFX bf16
#define ES_TGT ES_TARGET_BF16
#define ES_VW 16
#define ES_F16C 1
#define ES_NEON 0
#elif ES_PATH == ES_ISA_NEON && ES_NEON_PATHS
#define ES_SFX neon
#define ES_TGT ES_TARGET_NEON
#define ES_VW 4
#define ES_F16C 0
#define ES_NEON 1
#else
#error "engram_path.h: ES_PATH is not a path with a template copy in this build"
#endif

#define ES_PATH_CAT2(a, b) a##_##b
#define ES_PATH_CAT(a, b) ES_PATH_CAT2(a, b)
#define ES_SF(name) ES_PATH_CAT(name, ES_SFX)
#define ES_KI static inline __attribute__((always_inline)) ES_TGT
