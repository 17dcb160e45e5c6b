# Type stubs of engram_stream/integrations/_records.pyx (keep in step with it).
import numpy as np
import numpy.typing as npt

# records uint8 [T, k, head_dim + head_dim/32] -> out uint16 (bf16 bits) [T, k, head_dim], as vLLM's
# and SGLang's kernels; zero_scale: what the e8m0 byte 0 scales by (vLLM 0.0, SGLang 2**-127);
# either array may have any strides
def records_to_bf16(records: npt.NDArray[np.uint8], out: npt.NDArray[np.uint16],
                    zero_scale: float = 0.0) -> None: ...

# records uint8 [n, row bytes] of GGUF type qtype (rows.gguf.record_type) -> out uint16 (bf16 bits)
# [n, row length]: gguf.quants.dequantize's values rounded to bf16 (nearest, ties to even)
def gguf_to_bf16(qtype: int, records: npt.NDArray[np.uint8], out: npt.NDArray[np.uint16]) -> None: ...
