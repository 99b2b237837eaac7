"""What machine a benchmark ran on: the CPU (model, family/model numbers, vector ISA) and
contbatch's kernel tier, written beside every figure."""

import os
import platform

import torch
import transformers

from contbatch import ops

_ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


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


# (vendor, family, model) of the CPU kinds this project's machines come in.
_KNOWN_KINDS = {("AuthenticAMD", "25", "17"): "zen4", ("AuthenticAMD", "25", "1"): "zen3",
                ("AuthenticAMD", "26", "2"): "zen5"}


def cpu_kind() -> str:
    """Which kind of CPU a result belongs to: "zen4", "zen3", "zen5", else "<vendor>-<family>-<model>";
    with "-<tier>" added when CONTBATCH_CPU_ISA forced a tier other than "auto"'s, and "-amx"
    where bf16 matmuls run in AMX tiles (the same CPU model comes with and without AMX exposed
    on these machines). Each kind has its own sections in docs/performance.md."""
    fields = _cpuinfo()
    vendor, family, model = fields.get("vendor_id", "?"), fields.get("cpu family", "?"), fields.get("model", "?")
    short_vendor = vendor.removeprefix("Genuine").removeprefix("Authentic").lower()
    kind = _KNOWN_KINDS.get((vendor, family, model)) or f"{short_vendor}-{family}-{model}"
    if ops.cpu_isa() != ops.best_cpu_isa():
        kind += f"-{ops.cpu_isa()}"
    if ops.amx_bf16_matmuls():
        kind += "-amx"
    return kind


def machine_info() -> dict:
    return {
        "cpu": cpu_description(),
        "cpu_kind": cpu_kind(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0],
    }
