"""What machine a benchmark ran on: the CPU (model, family/model numbers, vector ISA) and
contbatch's kernel tier, written beside every figure."""

import os
import platform

import torch
import transformers

from contbatch import ops

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_description() -> str:
    """E.g. "AMD EPYC 7B13 (family 25 model 1; avx2 fma), kernel tier avx2"."""
    fields = _cpuinfo()
    flags = set(fields.get("flags", "").split())
    isa = " ".join(flag for flag in _ISA_FLAGS if flag in flags) or "no AVX2"
    return (f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}; {isa}), kernel tier {ops.cpu_isa() or 'reference ops'}")


def machine_info() -> dict:
    return {
        "cpu": cpu_description(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0],
    }
