#!/bin/sh
# CI step: vLLM 0.33.0 and SGLang 0.5.23 on CPU and the serving integrations' tests
# (tests/integrations/test_vllm.py, test_vllm_graph.py, test_vllm_qwen.py, test_vllm_longcat.py, test_sglang.py,
# test_sglang_qwen.py, test_sglang_longcat.py).
#
#   tools/ci_vllm.sh            # makes its own venv ($TMPDIR/engram-stream-ci-vllm-venv)
#   tools/ci_vllm.sh VENV       # installs into the venv VENV (the CI venv), then tests
#
# vLLM goes in with --no-deps (its CUDA deps cannot be met on CPU) beside the CPU torch from
# /opt/wheels (PIP_FIND_LINKS), with the pure-Python packages its import of the V4.1 Engram
# module (and of the Qwen4Exp PLE n-gram module) needs and triton; its kernels run in Triton's interpreter (TRITON_INTERPRET=1).
# The checkout is built in place (python setup.py build_ext --inplace) and tested from its root.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-${TMPDIR:-/tmp}/engram-stream-ci-vllm-venv}
export PIP_FIND_LINKS=${PIP_FIND_LINKS:-/opt/wheels} PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY=$VENV/bin/python
"$PY" -m pip install -q "torch==2.13.0" "triton==3.9.0" "ml_dtypes>=0.5" "Cython>=3.0,<4" "setuptools>=77" \
    pytest hypothesis
"$PY" -m pip install -q --no-deps "vllm==0.33.0"
# what `import vllm.models.deepseek_v41.common.engram` needs (vLLM's pure-Python deps, pinned as
# tested; no CUDA packages): --no-deps, so nothing replaces the CPU torch
"$PY" -m pip install -q --no-deps \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
    annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 \
    cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 \
    cloudpickle==3.1.3 einops==0.8.2 fastapi==0.165.0 filelock==4.3.1 frozenlist==1.8.0 \
    fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2 \
    huggingface_hub==2.4.0 idna==3.20 Jinja2==3.1.6 jiter==0.19.0 llguidance==1.9.1 \
    markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0 msgspec==0.23.0 \
    multidict==7.2.1 networkx==3.6.1 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8 \
    opentelemetry-api==1.45.2 packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \
    prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 \
    pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0 \
    regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 \
    sniffio==1.3.1 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.3 tqdm==4.70.1 \
    transformers==5.24.0 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 \
    typing_extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
# the plugin's Mooncake test: the store's client and its server binaries (CPU build; needs
# Debian's libibverbs1); its deps (aiohttp, requests: pinned above; msgpack) leave torch alone
"$PY" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# SGLang 0.5.23 for tests/integrations/test_sglang.py and test_sglang_qwen.py: --no-deps, with
# the (CPU) packages its import of sglang.srt.layers.engram and sglang.srt.models.qwen4_exp needs
# (torchvision, which has no CPU wheel here, is stubbed by the test)
"$PY" -m pip install -q --no-deps "sglang==0.5.23" orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 \
    dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
cd "$ROOT"
"$PY" setup.py -q build_ext --inplace -j 2
TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -p no:cacheprovider tests/integrations/test_vllm.py \
    tests/integrations/test_vllm_graph.py tests/integrations/test_vllm_qwen.py tests/integrations/test_vllm_longcat.py
# a process of its own: its torchvision stub stays out of the vLLM tests
CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -p no:cacheprovider tests/integrations/test_sglang.py \
    tests/integrations/test_sglang_qwen.py tests/integrations/test_sglang_longcat.py
