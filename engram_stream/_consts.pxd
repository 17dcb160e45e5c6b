# The shared constants (include/engram_consts.h), for every .pyx that needs them.
cdef extern from "engram_consts.h":
    enum:
        ES_MAX_NGRAM
        ES_MAX_KERNEL_SIZE
        ES_PREFILL_CHUNK
    float ES_EPS_KEY
    float ES_EPS_CONV
    float ES_GATE_CLAMP
