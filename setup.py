"""Build FusedReducer's C++ (and, when a CUDA toolkit and a CUDA build of torch are present,
CUDA/NCCL) extension.

    pip install --no-build-isolation .      # fast path: uses the torch already installed
    pip install --no-build-isolation ".[bench]"   # extras: bench, hf, lightning, ft, test

The torch version compiled against is written to python/fused_reducer/_build_torch.py (checked
at import).

Environment: CUDA_HOME (toolkit; default /usr/local/cuda when it has nvcc), NCCL_HOME (headers
and libnccl; default the nvidia-nccl-cu* wheel torch depends on), FUSED_REDUCER_NO_CUDA=1 (force
a CPU-only build), TORCH_CUDA_ARCH_LIST (default "8.0;9.0").
"""
import glob
import os
import shutil

from setuptools import find_packages, setup


def find_cuda_home():
    """torch guesses CUDA_HOME from `which nvcc` (here /usr/local, wrong); prefer a real toolkit."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and (
            glob.glob(os.path.join(home, "lib64", "libcudart.so*"))
            or glob.glob(os.path.join(home, "targets", "*", "lib", "libcudart.so*"))
        ):
            return home
    return None


CUDA_HOME = find_cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME  # before torch.utils.cpp_extension reads it

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def find_nccl():
    """(include_dir, lib_dir) of the NCCL that torch itself loads, or None."""
    home = os.environ.get("NCCL_HOME")
    if home:
        return os.path.join(home, "include"), os.path.join(home, "lib")
    try:
        import nvidia.nccl
    except ImportError:
        return None
    root = list(nvidia.nccl.__path__)[0]
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if os.path.exists(os.path.join(include, "nccl.h")) and glob.glob(os.path.join(lib, "libnccl.so*")):
        return include, lib
    return None


def use_cuda():
    if os.environ.get("FUSED_REDUCER_NO_CUDA") == "1":
        return False, "FUSED_REDUCER_NO_CUDA=1"
    if not torch.version.cuda:
        return False, "torch is a CPU-only build"
    if not CUDA_HOME:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    if find_nccl() is None:
        return False, "no NCCL found (install nvidia-nccl-cu* or set NCCL_HOME)"
    return True, f"CUDA {torch.version.cuda}, toolkit {CUDA_HOME}"


ROOT = os.path.dirname(os.path.abspath(__file__))


def record_build_torch():
    """Write the torch version this build compiles against into the package: __init__ compares
    it with the running torch before loading _C (an extension built against another torch fails
    with undefined symbols, or worse)."""
    path = os.path.join(ROOT, "python", "fused_reducer", "_build_torch.py")
    text = ("# Written by setup.py at build time (not in git): the torch _C was compiled against.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


record_build_torch()

cpp_sources = sorted(glob.glob("ext/*.cpp"))
cuda_sources = sorted(glob.glob("cuda/*.cu")) + sorted(glob.glob("cuda/*.cpp"))
with_cuda, why = use_cuda()
# -fopenmp-simd: the `omp simd` loops of ext/bucket_copy.cpp, without the OpenMP runtime.
cxx_flags = ["-O3", "-std=c++20", "-fopenmp-simd"]


def torchs_libstdcxx():
    """The linker argument that gives the extension torch's own C++ runtime.

    The extension lives in torch's process and must share its libstdc++: a second, static copy
    (the GPU machines' g++ links one, and there `-lstdc++` found no shared library either) keeps
    locale state of its own, and the first `std::ostringstream << n` crashed. The very file this
    process loaded with torch, named before the driver's own libraries, resolves every C++ runtime
    symbol, so no static copy is pulled in."""
    try:
        with open("/proc/self/maps") as maps:  # Linux; elsewhere the toolchain's default
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return [path]
    except OSError:
        pass
    return []  # no libstdc++ loaded (libc++, not Linux): nothing to add


link_shared_libstdcxx = torchs_libstdcxx()
print(f"fused_reducer: C++ runtime {link_shared_libstdcxx or 'the toolchain default'}")

if with_cuda and cuda_sources:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    nccl_include, nccl_lib = find_nccl()
    print(f"fused_reducer: building with CUDA ({why}), NCCL from {nccl_lib}, "
          f"arch {os.environ['TORCH_CUDA_ARCH_LIST']}")
    nccl_so = sorted(glob.glob(os.path.join(nccl_lib, "libnccl.so*")))[0]
    extension = CUDAExtension(
        "fused_reducer._C",
        cpp_sources + cuda_sources,
        include_dirs=[os.path.join(ROOT, "ext"), os.path.join(ROOT, "cuda"), nccl_include],
        define_macros=[("FUSED_REDUCER_WITH_CUDA", "1"),
                       ("FUSED_REDUCER_CUDA_ARCH_LIST", '"' + os.environ["TORCH_CUDA_ARCH_LIST"] + '"')],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]},
        # Link the very libnccl.so.2 torch loads, so one NCCL lives in the process: found next to
        # the installed package (site-packages/nvidia/nccl/lib), else where it was at build time.
        extra_link_args=[nccl_so, "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib", f"-Wl,-rpath,{nccl_lib}"]
        + link_shared_libstdcxx,
    )
else:
    if not with_cuda:
        print(f"fused_reducer: skipping CUDA ({why}); building the CPU/process-group path only")
    extension = CppExtension(
        "fused_reducer._C",
        cpp_sources,
        include_dirs=[os.path.join(ROOT, "ext")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_shared_libstdcxx,
    )

setup(
    name="fused_reducer",
    version="0.1.0",
    description="Bucketed gradient all-reduce for data-parallel PyTorch with a runtime-tunable first bucket",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    # No install_requires on torch: the extension is tied to the torch it was built against, and
    # a resolver must never swap it. Extras: `pip install --no-build-isolation ".[lightning]"`.
    extras_require={
        "lightning": ["pytorch-lightning"],
        "bench": ["torchvision==0.29.1", "transformers"],  # torchvision 0.29.x pairs with torch 2.14
        # fused_reducer.accelerate / fused_reducer.transformers; tested with these versions.
        "hf": ["accelerate>=1.16", "transformers>=5.25"],
        # fused_reducer.torchft (fault-tolerant replica groups); it reads torchft's Manager and
        # managed work at this version (docs/FAULT_TOLERANCE.md).
        "ft": ["torchft==0.2.0"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "numpy", "matplotlib", "pytorch-lightning",
                 "accelerate", "transformers", "torchft==0.2.0"],
    },
)
