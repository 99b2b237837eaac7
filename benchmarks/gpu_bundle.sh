#!/usr/bin/env bash
# What gpu_check.sh needs on a GPU machine with no network, cut to fit a size limit per
# transfer (the GPU machines this project is lent take 64 MiB a call, the repo included):
#   BUNDLE/whl/   wheels for the machine's Python of what its CUDA image lacks and the tests
#                 import (gguf, llguidance, jsonschema and its own needs)
#   BUNDLE/p0/, BUNDLE/p1/, ...  the demo GGUF file (98 MB) in parts of at most PART_MIB, one
#                 a folder, so that each call carries one; each also holds gguf.sha256, which
#                 checks the join (so the call that joins carries it without naming it)
#
#   bash benchmarks/gpu_bundle.sh BUNDLE [PART_MIB] [PYTHON_VERSION]   # defaults: 48, 3.12
# GPU_BUNDLE_NO_WHEELS=1 skips the wheels (no network here). PYTHON: the Python that runs
# contbatch here (default python3), to find or fetch the demo GGUF file.
#
# On the GPU machine, each call copies its part to one place (a machine kept warm between
# calls keeps it); the first can build (GPU_CHECK_STEPS=build), the last joins the parts:
#   mkdir -p /tmp/cb && cp BUNDLE/p0/* /tmp/cb/
#   cp BUNDLE/p1/* /tmp/cb/ && cat /tmp/cb/part_* > /tmp/cb/SmolLM2-135M-Instruct.Q4_1.gguf
#   (cd /tmp/cb && sha256sum -c gguf.sha256 && rm part_*) && export CONTBATCH_CACHE=/tmp/cb
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site BUNDLE/whl/*.whl
#   PYTHONPATH=/tmp/site CXX=/usr/bin/g++ GPU_CHECK_STEPS="throughput suite" \
#     bash benchmarks/gpu_check.sh OUT_DIR 540
# What fitted a 15-minute lease on an H200 (2026-11-27, docs/design/experiments.md): call 1
# (p0, whl) built (96 s) and ran the cuda cases that need no real weights; call 2 (p1, whl),
# sent as soon as call 1 returned (a warm machine goes back 30 s after a call), ran
# GPU_CHECK_STEPS=suite (322 s on 8 workers); call 3 ran gpu_throughput.py (129 s). Two calls
# did it on 2026-11-28 (657 s with the start): call 1 GPU_CHECK_STEPS="build cuda_tests"
# (133 s), call 2 GPU_CHECK_STEPS="throughput suite" (460 s: chat256 then the suite in 288 s).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_bundle.sh BUNDLE [PART_MIB] [PYTHON_VERSION]}
part_mib=${2:-48}
python_version=${3:-3.12}
mkdir -p "$out"

gguf=$("${PYTHON:-python3}" -c "from contbatch.demo_model import demo_gguf_path; print(demo_gguf_path())")
rm -rf "$out"/p[0-9]* "$out/gguf.sha256"
(cd "$out" && split -b "${part_mib}M" -d -a 2 "$gguf" part_)
index=0
for part in "$out"/part_*; do
  mkdir -p "$out/p$index" && mv "$part" "$out/p$index/"
  index=$((index + 1))
done
checksum=$(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")")
for part_dir in "$out"/p[0-9]*; do echo "$checksum" > "$part_dir/gguf.sha256"; done
echo "gpu_bundle: $(basename "$gguf") in $index parts of at most $part_mib MiB under $out/p*/"

if [[ ${GPU_BUNDLE_NO_WHEELS:-0} != 1 ]]; then
  platforms=()
  for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d "$out/whl" \
    "gguf>=0.10" "llguidance>=1.9,<2" "jsonschema>=4" jsonschema-specifications referencing rpds-py
  echo "gpu_bundle: wheels for Python $python_version under $out/whl/"
fi
du -sh "$out"/* | sed 's/^/gpu_bundle: /'
