#!/usr/bin/env bash
# Test the aarch64 build on an x86-64 machine: cross-build the extensions with aarch64-linux-gnu-gcc,
# run the kernel, contract and variant tests under qemu-aarch64-static on -cpu max (FEAT_BF16) and
# -cpu cortex-a72 (plain ARMv8.0), the kernel paths baseline and neon, neon_bf16's own tests (BFDOT:
# its kernel and one engine per bf16 variant) on max, and compare outputs with the x86 goldens.
#
#   tools/test_aarch64.sh                 the whole suite (CI runs this)
#   tools/test_aarch64.sh -k gather ...   extra arguments go to every pytest run
#
# Needs: the host python that builds the checkout (Cython, numpy, setuptools: `python` on PATH, or
# $PYTHON); gcc-aarch64-linux-gnu and qemu-user-static (installed with apt-get when root and missing).
# The arm64 userland (Debian's arm64 python3.11 packages unpacked with dpkg -x, and numpy, ml_dtypes,
# pytest, hypothesis, safetensors from their PyPI aarch64 wheels at the host's versions) is built once
# into $ENGRAM_AARCH64_CACHE (default ~/.cache/engram_aarch64) and reused; the build is a copy of the
# checkout under that cache (one per checkout path): no aarch64 file lands in the checkout.
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${ENGRAM_AARCH64_CACHE:-$HOME/.cache/engram_aarch64}
PYTHON=${PYTHON:-python}
CPUS=${ENGRAM_AARCH64_CPUS:-"max cortex-a72"}
ROOT=$CACHE/root            # the arm64 userland: Debian's python3.11 and its libraries
SITE=$CACHE/site            # the wheels' packages (PYTHONPATH)
BUILD=$CACHE/build/$(printf %s "$HERE" | sha1sum | cut -c1-12)/src
start=$SECONDS
say() { printf '[aarch64 %4ds] %s\n' $((SECONDS - start)) "$*"; }

# ---- tools ---------------------------------------------------------------------------------------
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null \
        || ! command -v aarch64-linux-gnu-objdump >/dev/null || [ ! -e /usr/aarch64-linux-gnu/include/stdlib.h ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "tools/test_aarch64.sh: needs aarch64-linux-gnu-gcc and qemu-aarch64-static:" \
             "apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils-aarch64-linux-gnu qemu-user-static (as root)" >&2
        exit 2
    fi
    say "installing the cross compiler and qemu-user (apt-get)"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils-aarch64-linux-gnu qemu-user-static >/dev/null
fi

# ---- the arm64 userland (once; rebuilt when the wanted versions change) ----------------------------
DEBS="libc6 libgcc-s1 libstdc++6 gcc-12-base zlib1g libbz2-1.0 liblzma5 libexpat1 libffi8 libssl3
      libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libcrypt1 libdb5.3 libnsl2 libtirpc3
      libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 libcom-err2
      libpython3.11-minimal libpython3.11-stdlib python3.11-minimal python3.11 libpython3.11 libpython3.11-dev"
WHEELS=$("$PYTHON" - <<'EOF'
# the test dependencies at the host's versions, with what they require (markers evaluated here)
import importlib.metadata as m, re
from packaging.requirements import Requirement
todo, seen = ["numpy", "ml_dtypes", "pytest", "hypothesis", "safetensors"], {}
while todo:
    d = m.distribution(todo.pop())
    name = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
    if name in seen:
        continue
    seen[name] = d.version
    for r in map(Requirement, d.requires or ()):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
)
WANT="debs: $(echo $DEBS) wheels: $WHEELS"
if [ ! -f "$CACHE/.userland" ] || [ "$(cat "$CACHE/.userland")" != "$WANT" ]; then
    say "laying the arm64 userland in $CACHE"
    rm -rf "$ROOT" "$SITE" "$CACHE/dl"
    mkdir -p "$ROOT" "$SITE" "$CACHE/dl/deb" "$CACHE/dl/whl"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        [ "$(id -u)" = 0 ] || { echo "tools/test_aarch64.sh: run 'dpkg --add-architecture arm64; apt-get update' as root" >&2; exit 2; }
        dpkg --add-architecture arm64
        apt-get update -q >/dev/null
    fi
    (cd "$CACHE/dl/deb" && apt-get download -q $(for d in $DEBS; do printf '%s:arm64 ' "$d"; done) >/dev/null) || {
        [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null
        (cd "$CACHE/dl/deb" && apt-get download -q $(for d in $DEBS; do printf '%s:arm64 ' "$d"; done) >/dev/null)
    }
    for d in "$CACHE"/dl/deb/*.deb; do dpkg -x "$d" "$ROOT"; done
    # the lib64 loader path the arm64 binaries name, inside the root
    [ -e "$ROOT/lib/ld-linux-aarch64.so.1" ] || ln -s ../usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1 "$ROOT/lib/ld-linux-aarch64.so.1" 2>/dev/null || true
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 \
        --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 --platform any \
        --python-version 3.11 --implementation cp -d "$CACHE/dl/whl" $WHEELS
    for w in "$CACHE"/dl/whl/*.whl; do "$PYTHON" -m zipfile -e "$w" "$SITE"; done
    rm -rf "$CACHE/dl"
    echo "$WANT" > "$CACHE/.userland"
fi
PYA="$ROOT/usr/bin/python3.11"
NPINC=$(ls -d "$SITE"/numpy/_core/include 2>/dev/null || ls -d "$SITE"/numpy/core/include)

# ---- the cross build, in a copy of the checkout ---------------------------------------------------
say "cross-building into $BUILD"
mkdir -p "$BUILD"
(cd "$HERE" && git ls-files -co --exclude-standard -z -- engram_stream include tests tools bench setup.py pyproject.toml \
    | grep -zv '\.so$' | tar --null -T - -cf -) | tar -xf - -C "$BUILD"  # mtimes kept: unchanged modules do not rebuild
(cd "$BUILD" && CC=aarch64-linux-gnu-gcc LDSHARED="aarch64-linux-gnu-gcc -shared" \
    CFLAGS="-I$ROOT/usr/include/python3.11 -I$ROOT/usr/include -I$NPINC" LDFLAGS="" \
    SETUPTOOLS_EXT_SUFFIX=.cpython-311-aarch64-linux-gnu.so \
    nice -n 10 "$PYTHON" setup.py -q build_ext --inplace -j 2 >build.log 2>&1) || { cat "$BUILD/build.log"; exit 1; }
"$PYTHON" - "$BUILD" <<'EOF' || exit 1
import glob, struct, sys  # every extension is an ELF for EM_AARCH64 (183)
sos = glob.glob(sys.argv[1] + "/engram_stream/**/*.so", recursive=True)
bad = [p for p in sos if struct.unpack("<H", open(p, "rb").read(20)[18:20])[0] != 183]
sys.exit(f"not aarch64 builds: {bad}" if bad or not sos else 0)
EOF

# ---- the suites under qemu ---------------------------------------------------------------------------
# The arm64 python as a host script (QEMU_CPU picks the CPU model): what sys.executable names (qemu -0),
# so the tests' subprocesses (run_python) start the emulated python again through the host kernel.
PYW="$CACHE/python3.11-qemu"
printf '#!/bin/sh\nexec qemu-aarch64-static -L "%s" -0 "$0" "%s" "$@"\n' "$ROOT" "$PYA" > "$PYW"
chmod +x "$PYW"
run() { # run CPU ARGS...: the arm64 python on that CPU model
    local cpu=$1; shift
    (cd "$BUILD" && QEMU_CPU=$cpu PYTHONPATH="$SITE" PYTHONDONTWRITEBYTECODE=1 \
        HYPOTHESIS_STORAGE_DIRECTORY=${HYPOTHESIS_STORAGE_DIRECTORY:-/tmp/engram_aarch64_hyp} "$PYW" "$@")
}
# Kernel paths against their oracles (every path the CPU runs: the each_isa tests run baseline and
# neon, pytest's header says which), the demo's, V4.1's and LongCat's goldens (made on x86: the same outputs as x86),
# the engines of both variants and the public contract (forward, step over streams, prefill then
# step, step_packed with a draft and a commit). On cortex-a72 (ARMv8.0: an instruction the build
# must not use would stop it there) the kernel suites and the demo engine's tests of its kernels
# only: the rest runs the same code.
KERNEL_TESTS=(tests/kernels/test_isa.py tests/kernels/test_hash_lanes.py tests/kernels/test_fp8_paths.py
              tests/demo/test_goldens.py tests/v41/test_goldens_v41.py tests/demo/test_bf16.py
              tests/v41/test_engine_v41.py tests/longcat/test_longcat_goldens.py tests/kernels/test_bfdot_path.py)
# neon_bf16 (max only: cortex-a72 lacks FEAT_BF16, test_bfdot_path.py checks it is not offered there)
# runs neon's kernels but for the GEMM of bf16 weights on bf16 rows: the each_isa runs keep to
# baseline and neon (ENGRAM_TEST_ISAS), and neon_bf16 runs its BFDOT tests (test_bfdot_path.py,
# above) and each bf16 variant's engine tests forced onto it (20-45 s under qemu)
BFDOT_TESTS=(tests/qwen/test_qwen_model.py::test_bfloat16_tables_and_projections_equal_the_oracle
             tests/longcat/test_longcat_model.py::test_bfloat16_table_and_projections
             tests/longcat/test_longcat_model.py::test_threads_give_the_same_bits_on_the_released_dtypes)
DEMO_KERNEL_TESTS=(tests/demo/test_engine.py::test_single_stream_matches_batch
                   tests/demo/test_engine.py::test_multi_stream_matches_batch
                   tests/demo/test_engine.py::test_quantized_tables_match_batch
                   tests/demo/test_engine.py::test_wide_layer_uses_gemv_and_tiles
                   tests/demo/test_engine.py::test_prefill_then_step
                   tests/demo/test_engine.py::test_step_threads_bitwise_equal_and_match_batch
                   tests/demo/test_engine.py::test_prefill_threads_bitwise_equal)
REST_TESTS=(tests/demo/test_engine.py tests/engine tests/contract/test_engine_contract.py tests/contract/test_serving.py)
# not here: threads racing, allocation counts and timing (nothing aarch64 changes; slow under qemu),
# and a fresh process per x86 path name (7 s each under qemu: the refusal is the same as for sse9)
# or for neon_bf16 (25 s each: BFDOT_TESTS start a process on it, test_bfdot_path.py checks its refusal)
SKIP="not concurrent_prefill and not alloc_native and not costs_little and not (environment and (avx2 or avx512 or neon_bf16))"
# The CPU models run side by side (each qemu process is one host thread; CI has two cores), each
# into a log of its own, printed in order once all have ended.
status=0
pids=()
for cpu in $CPUS; do
    got=$(ENGRAM_STREAM_ISA= run "$cpu" -c 'import platform, engram_stream as e; from engram_stream.engine import isa
print(platform.machine(), e.kernel_isa(), ",".join(isa.supported_isas()))')  # the default path (no ENGRAM_STREAM_ISA)
    say "-cpu $cpu: machine, kernel_isa() by default, paths: $got"
    want="aarch64 neon baseline,neon"
    [ "$cpu" = max ] && want="aarch64 neon_bf16 baseline,neon,neon_bf16"  # FEAT_BF16 (HWCAP2_BF16)
    [ "$got" = "$want" ] || { echo "-cpu $cpu: expected '$want' (machine, default path, paths)" >&2; status=1; }
    tests=("${KERNEL_TESTS[@]}")
    if [ "$cpu" = max ]; then tests+=("${REST_TESTS[@]}"); else tests+=("${DEMO_KERNEL_TESTS[@]}"); fi
    say "-cpu $cpu: ${#tests[@]} test files and tests, in the background"
    (export HYPOTHESIS_STORAGE_DIRECTORY=/tmp/engram_aarch64_hyp_$cpu; st=0
     ENGRAM_TEST_ISAS=baseline,neon run "$cpu" -m pytest -p no:cacheprovider \
        "${tests[@]}" -k "$SKIP" "$@" > "$CACHE/pytest-$cpu.log" 2>&1 || st=1
     if [ "$cpu" = max ]; then ENGRAM_STREAM_ISA=neon_bf16 run "$cpu" -m pytest -p no:cacheprovider \
        "${BFDOT_TESTS[@]}" "$@" >> "$CACHE/pytest-$cpu.log" 2>&1 || st=1; fi
     exit $st) &
    pids+=($!)
done
i=0
for cpu in $CPUS; do
    wait "${pids[$i]}" || status=1
    i=$((i + 1))
    say "-cpu $cpu:"
    grep -v '^\(platform\|cachedir\|rootdir\|configfile\|plugins\|hypothesis\|collected\) ' "$CACHE/pytest-$cpu.log" || true
done
say "done (status $status)"
exit $status
