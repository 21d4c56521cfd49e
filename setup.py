"""Builds flashattn_ext._C: the CPU kernels always, and the CUDA sources when
nvcc and a CUDA-enabled torch are both present, unless FLASHATTN_EXT_CPU_ONLY=1.
FLASHATTN_EXT_REQUIRE_CUDA=1 makes a missing CUDA toolchain an error (CI sets it).
"""
import glob
import os
import subprocess
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# Ampere (A100) and Hopper (H100, with its arch-specific features). Override with
# TORCH_CUDA_ARCH_LIST, e.g. "9.0a" to build for one GPU only.
DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def cuda_build_status():
    """Returns (build_cuda, reason it is not built)."""
    if os.environ.get("FLASHATTN_EXT_CPU_ONLY") == "1":
        return False, "FLASHATTN_EXT_CPU_ONLY=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA support"
    if CUDA_HOME is None:
        return False, "nvcc (the CUDA toolkit) was not found"
    return True, ""


def shared_libstdcxx_link_args():
    """Link flags that keep the C++ runtime shared with torch's.

    A compiler that finds no libstdc++.so in its own search path (a GCC wrapper whose
    lib dir holds only libstdc++.a) links a static copy into the extension; with that
    second runtime beside torch's, formatting a number into an error message crashed.
    Then name the shared library itself."""
    compiler = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [] if os.path.isabs(found.strip()) else ["-l:libstdc++.so.6"]


def sources(*patterns):
    return sorted(path for pattern in patterns for path in glob.glob(pattern))


build_cuda, why_not = cuda_build_status()
if not build_cuda and os.environ.get("FLASHATTN_EXT_REQUIRE_CUDA") == "1":
    raise RuntimeError(f"flashattn_ext: FLASHATTN_EXT_REQUIRE_CUDA=1 but the CUDA sources cannot be built: {why_not}")
# ATen's at::parallel_for is a header template: compiled without OpenMP, it ran
# the CPU kernels' tasks one after another, on one core. Torch's own libgomp is
# loaded already, so linking OpenMP adds no second runtime.
openmp_flags = ["-fopenmp"] if torch.backends.openmp.is_available() and sys.platform.startswith("linux") else []
# -fno-trapping-math (as torch builds with): the CPU kernels' selects between float
# values may then compile to vector code.
cxx_flags = ["-O3", "-fno-trapping-math"] + openmp_flags
link_args = shared_libstdcxx_link_args() + openmp_flags
common_sources = sources("csrc/*.cpp", "csrc/cpu/*.cpp")
if build_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    # The Hopper kernels (csrc/cuda/sm90/) need the 9.0a target; without it they
    # compile to empty bodies and the glue never calls them.
    has_sm90a = "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    defines = ["-DFLASHATTN_EXT_HAS_SM90A"] if has_sm90a else []
    common_sources.remove("csrc/cuda_not_built.cpp")
    extension = CUDAExtension(
        "flashattn_ext._C",
        common_sources + sources("csrc/cuda/*.cpp", "csrc/cuda/*.cu", "csrc/cuda/sm80/*.cu", "csrc/cuda/sm90/*.cu"),
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": cxx_flags + defines, "nvcc": ["-O3"] + defines},
        extra_link_args=link_args,
    )
else:
    print(f"flashattn_ext: building for CPU only ({why_not}); CUDA tensors will raise an error")
    extension = CppExtension(
        "flashattn_ext._C",
        common_sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_args,
    )

setup(
    packages=find_packages(include=["flashattn_ext", "flashattn_ext.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
)
