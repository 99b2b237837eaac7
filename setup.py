"""Builds the optional C++ extension ``contbatch._C`` (see csrc/).

The package works without it (pure-PyTorch reference ops), so a failed or skipped
build never blocks installation: set CONTBATCH_NO_EXT=1 to skip it on purpose, or
CONTBATCH_REQUIRE_EXT=1 to make a failed build an error (CI). CONTBATCH_CXX_OPT (-O0 to -O3,
default -O3) sets the C++ sources' optimization level: CI's CUDA compile check (.ci/build_cuda.sh)
builds them at -O0, since it only checks that the extension compiles, links and registers.
They build without debug information (-g0, over the -g of Python's CFLAGS) unless
CONTBATCH_CXX_DEBUG=1: the kernels' templates made -g double their compile time and put 48 of
the 53 MB of the library into it; symbol names (perf, backtraces) stay either way.

CPU: csrc/*.cpp and csrc/cpu/*.cpp. No -march flag: the kernels are compiled once per ISA
tier (AVX2, AVX-512, AVX-512 + AVX512_BF16) through function-level target pragmas
(csrc/cpu/kernels_<tier>.cpp) and once portably, and the best tier the CPU has is chosen at
run time (csrc/cpu/cpu_isa.cpp), so one build runs anywhere. CUDA: csrc/cuda/*.cu are added when
torch is a CUDA build and a CUDA toolkit is found (CUDA_HOME).
"""

import glob
import os
import warnings

from setuptools import setup

NAME = "contbatch._C"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


OPT_LEVELS = ("-O0", "-O1", "-O2", "-O3")


def _cxx_opt_level() -> str:
    level = os.environ.get("CONTBATCH_CXX_OPT", "-O3")
    if level not in OPT_LEVELS:
        raise ValueError(f"CONTBATCH_CXX_OPT must be one of {', '.join(OPT_LEVELS)}, got {level!r}")
    return level


def _extension_setup() -> dict:
    """ext_modules and cmdclass for setup(), empty when the extension is skipped."""
    if _flag("CONTBATCH_NO_EXT"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        if _flag("CONTBATCH_REQUIRE_EXT"):
            raise
        warnings.warn(f"torch is not importable ({exc}); building contbatch without {NAME}", stacklevel=1)
        return {}

    class OptionalBuildExtension(BuildExtension):
        """BuildExtension that warns instead of failing, unless CONTBATCH_REQUIRE_EXT=1."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # any compiler or toolchain failure: fall back to reference ops
                if _flag("CONTBATCH_REQUIRE_EXT"):
                    raise
                warnings.warn(f"building {NAME} failed ({exc}); contbatch will use the reference ops", stacklevel=1)

    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # The C++ standard is torch's default (C++20 for torch 2.13). -fopenmp: at::parallel_for
    # is inlined OpenMP code in torch's CPU builds; it binds to the libgomp torch loads.
    cxx = [_cxx_opt_level(), "-g" if _flag("CONTBATCH_CXX_DEBUG") else "-g0", "-fopenmp"]
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and bool(cuda_sources)
    kwargs = dict(
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
        extra_link_args=["-fopenmp"],
    )
    if with_cuda:
        extension = CUDAExtension(NAME, sources + cuda_sources, **kwargs)
    else:
        extension = CppExtension(NAME, sources, **kwargs)
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_extension_setup())
