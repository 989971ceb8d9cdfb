"""Builds freetoken._C, FreeToken's compiled kernels (csrc/).

The CPU kernels are always built. The CUDA implementation (csrc/cuda/*.cu plus the torch
glue csrc/cuda/ops_cuda_glue.cpp) is added, with -DWITH_CUDA, only when torch itself has CUDA
(torch.version.cuda) and a toolkit is found (CUDA_HOME or nvcc on PATH); building it needs a
toolchain, not a GPU.

Environment:
  FREETOKEN_NO_EXT=1   pure-Python install (freetoken.ops then uses its torch twins)
  FREETOKEN_NO_CUDA=1  never build the CUDA part
  DEBUG=1              -O0 -g

Documented commands (torch 2.13.0 must already be installed; isolation would fetch another):
  pip install --no-build-isolation -e .
  pip wheel --no-build-isolation --no-deps -w dist .
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _compiler_accepts(flag: str) -> bool:
    """Whether the C++ compiler the build will use compiles an empty file with `flag`."""
    cxx = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")
    try:
        done = subprocess.run([*cxx, flag, "-x", "c++", "-c", "-", "-o", os.devnull],
                              input=b"int main() { return 0; }\n", capture_output=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _cuda_available() -> bool:
    if _flag("FREETOKEN_NO_CUDA"):
        return False
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return False
    return cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None


def get_extensions():
    if _flag("FREETOKEN_NO_EXT"):
        return []
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = _flag("DEBUG")
    # -g0: Python's own CFLAGS carry -g, which made the .so 16 MB of debug info
    cxx = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    cxx += ["-fno-math-errno", "-ffp-contract=fast", "-Wno-psabi"]
    # NOTE: batch invariance (issue 23) needs every path of a kernel to fuse a * b + c the same
    # way. GCC 13's generic tuning splits some FMA chains into a multiply and an add (its
    # "avoid FMA chains"), in some loops and not others: built with GCC 13.3, chunked attention
    # lost its bits, in the AVX2 and the AVX-512 kernels alike. Off, every contraction is kept.
    if _compiler_accepts("--param=avoid-fma-max-bits=0"):
        cxx.append("--param=avoid-fma-max-bits=0")
    # NOTE: no -march: the wheel must run on any x86-64. The wide kernels are compiled per ISA
    # through target attributes (csrc/common/isa.h) and picked at run time (cpuid).
    # csrc/bindings.cpp, csrc/common/*.cpp and one folder per op (csrc/<op>/*.cpp); csrc/cuda/
    # only with CUDA (below).
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(p for p in glob.glob(os.path.join("csrc", "*", "*.cpp"))
                      if os.path.basename(os.path.dirname(p)) != "cuda")
    macros = []
    extra = {"cxx": cxx}
    ext_cls = CppExtension
    if _cuda_available():
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        macros.append(("WITH_CUDA", None))
        extra["nvcc"] = (["-O0", "-g", "-G"] if debug else ["-O3"]) + [
            "-std=c++17",
            "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_90,code=sm_90",
        ]
        ext_cls = CUDAExtension
    return [
        ext_cls(
            "freetoken._C",
            sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            define_macros=macros,
            extra_compile_args=extra,
        )
    ]


def _cmdclass():
    if _flag("FREETOKEN_NO_EXT"):
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(ext_modules=get_extensions(), cmdclass=_cmdclass())
