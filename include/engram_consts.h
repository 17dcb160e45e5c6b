/* engram_consts.h: the one source of the constants C, Cython and Python share.
 *
 * Python sees them through engram_stream._hash (MAX_NGRAM, MAX_KERNEL_SIZE, EPS_KEY,
 * EPS_CONV, GATE_CLAMP, PREFILL_CHUNK); tests/kernels/test_consts.py checks that the values
 * there equal the ones written here. Change a value here and nowhere else.
 */
#ifndef ENGRAM_CONSTS_H
#define ENGRAM_CONSTS_H

/* Largest max_ngram_size: the hash kernels keep a window of this many ids on the stack. */
#define ES_MAX_NGRAM 64
/* Largest ShortConv kernel_size the engine takes (its conv state holds (K-1)*max_ngram rows
 * of G*D floats per stream; the limit keeps that and the tap list bounded). */
#define ES_MAX_KERNEL_SIZE 1024
/* RMSNorm eps of the keys and the hidden state: float32 machine epsilon (2^-23), torch's
 * default when eps is None. */
#define ES_EPS_KEY 1.1920928955078125e-07f
/* RMSNorm eps of the ShortConv norms. */
#define ES_EPS_CONV 1e-5f
/* The gate's clamp: sign(s) * sqrt(max(|s|, ES_GATE_CLAMP)). */
#define ES_GATE_CLAMP 1e-6f
/* Prompt tokens per GEMM in StreamEngine.prefill (scratch ~ chunk x (E + M) floats). */
#define ES_PREFILL_CHUNK 128

#endif /* ENGRAM_CONSTS_H */
