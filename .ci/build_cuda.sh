#!/usr/bin/env bash
# Checks that the CUDA half of contbatch._C (csrc/cuda/*.cu) compiles, links and registers
# its kernels, on a machine without a GPU: a separate venv with a CUDA build of torch, the
# extension built from a scratch copy of the repo (the CPU build in the repo is untouched),
# then the built library loaded and every op checked for a CUDA kernel.
# Env: CB_CUDA_VENV (default /tmp/cb-cuda-venv, reused when it already has the torch),
# CB_CUDA_TORCH (default 2.14.1), MAX_JOBS (default: every core; nothing else runs beside it in
# .ci/run, and at one job this check took 489 of CI's 1,580 s, at two 216). The C++ (CPU) sources
# build at -O0 (CONTBATCH_CXX_OPT, setup.py): this check runs none of their code, only compiles,
# links and registers them beside the CUDA kernels (nvcc keeps -O3); with setup.py's -g0 too, 59 s
# instead of 168 for the build on an Emerald Rapids Xeon with 2 cores. The optimized CPU build is
# the one the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv=${CB_CUDA_VENV:-/tmp/cb-cuda-venv}
torch_version=${CB_CUDA_TORCH:-2.14.1}

# The toolkit whose runtime library is there, not whatever nvcc is first on PATH.
cuda_home=""
for dir in /usr/local/cuda-13.0 /usr/local/cuda-13* /usr/local/cuda; do
  if [ -e "$dir/lib64/libcudart.so" ] && [ -x "$dir/bin/nvcc" ]; then
    cuda_home=$dir
    break
  fi
done
if [ -z "$cuda_home" ]; then
  echo "build_cuda: no CUDA 13 toolkit with lib64/libcudart.so under /usr/local" >&2
  exit 1
fi

if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version' or torch.version.cuda is None)" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install "torch==$torch_version" setuptools wheel > "$venv.pip.log" 2>&1 ||
    { tail -20 "$venv.pip.log"; echo "build_cuda: installing torch==$torch_version failed" >&2; exit 1; }
fi
"$venv/bin/python" -c "import torch; print(f'build_cuda: torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME=$cuda_home')"
echo "build_cuda: venv ready after $((SECONDS - start)) s"

scratch=$(mktemp -d /tmp/cb-cuda-build.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
cp -r setup.py pyproject.toml csrc contbatch "$scratch/"
find "$scratch" -name '*.so' -delete
build_start=$SECONDS
(
  cd "$scratch"
  CUDA_HOME=$cuda_home PATH="$cuda_home/bin:$PATH" TORCH_CUDA_ARCH_LIST="8.0;9.0" MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    CONTBATCH_CXX_OPT=-O0 CONTBATCH_REQUIRE_EXT=1 "$venv/bin/python" setup.py -q build_ext --inplace > build.log 2>&1 ||
    { grep -E -A3 "error|FAILED" build.log | head -60; echo "build_cuda: build failed" >&2; exit 1; }
)
echo "build_cuda: extension built in $((SECONDS - build_start)) s"

library=$(ls "$scratch"/contbatch/_C*.so)
"$venv/bin/python" -W ignore::UserWarning - "$library" <<'PY'
import sys

import torch

torch.ops.load_library(sys.argv[1])
missing = [
    f"contbatch::{op} ({key})"
    for op in ("reshape_and_cache", "paged_attention", "copy_blocks")
    for key in ("CPU", "CUDA")
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"contbatch::{op}", key)
]
if missing:
    sys.exit(f"build_cuda: no kernel registered for {', '.join(missing)}")
print("build_cuda: CPU and CUDA kernels registered for all 3 ops")
PY
echo "build_cuda: passed in $((SECONDS - start)) s"
