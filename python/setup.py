# The pip path for kvevict's Python package (docs/python.md):
#
#     python3 -m pip install --no-build-isolation ./python
#
# offline, with Debian's python3-pip, python3-setuptools, python3-pybind11 and pybind11-dev (and
# python3-dev for the headers; scripts/setup installs them): setuptools and pybind11's setup helpers
# compile the same host sources as the CMake target kvevict_python (python/CMakeLists.txt) against
# the library's headers in ../include and CCCL's (find_cccl: the CUDA toolkit's copy, or
# CCCL_INCLUDE_DIR), with OpenMP (the par backend). No CUDA code: the CUDA path is built by CMake
# (the `cuda` preset) only.
#
# KVEVICT_PREBUILT_CORE=<path to a built _core*.so> packages that module instead of compiling (the
# CTest python.pip uses the release build's module, so CI compiles the extension once);
# KVEVICT_BUILD_JOBS sets the parallel compile jobs (default 2).
import glob
import os
import re
import shutil
import sys

from setuptools import setup

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
except ImportError:  # pragma: no cover - a clear message for a missing Debian package
    sys.exit("kvevict: pybind11's setup helpers are missing (Debian: apt-get install python3-pybind11 pybind11-dev); "
             "install with --no-build-isolation so pip uses them")

here = os.path.dirname(os.path.abspath(__file__))
include = os.path.normpath(os.path.join(here, "..", "include"))
if not os.path.isfile(os.path.join(include, "kvevict", "kvevict.hpp")):
    sys.exit(f"kvevict: the library's headers are not at {include}: install from a kvevict source tree "
             "(pip install --no-build-isolation ./python from its top directory)")


def find_cccl():
    """CCCL's headers (libcu++: cuda/std/array, mdspan; the library's one dependency, header-only):
    CCCL_INCLUDE_DIR, else the CUDA toolkit's copy under CUDA_PATH, CUDA_HOME or /usr/local/cuda
    (include/cccl, or include for toolkits that ship it there) -- what cmake/kvevictFindCCCL.cmake finds."""
    given = os.environ.get("CCCL_INCLUDE_DIR")
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    candidates = [given] if given else [os.path.join(r, sub) for r in roots if r for sub in ("include/cccl", "include")]
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda", "std", "array")):
            return c
    sys.exit("kvevict: CCCL's headers (cuda/std/array) were not found in " + ", ".join(candidates) +
             ": set CCCL_INCLUDE_DIR to a standalone CCCL's include directory, or CUDA_PATH to a CUDA toolkit")


def project_version():
    """The version of the top-level CMakeLists.txt's project() (one home for it)."""
    path = os.path.join(here, "..", "CMakeLists.txt")
    try:
        with open(path) as f:
            m = re.search(r"project\(kvevict\s+VERSION\s+([0-9.]+)", f.read())
    except OSError:
        m = None
    if not m:
        sys.exit(f"kvevict: no `project(kvevict VERSION x.y.z` in {os.path.normpath(path)}")
    return m.group(1)


sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "src", "*.cpp")))

ParallelCompile("KVEVICT_BUILD_JOBS", default=2).install()


class build_core(build_ext):
    """Compiles _core, or copies the module KVEVICT_PREBUILT_CORE names."""

    def build_extension(self, ext):
        prebuilt = os.environ.get("KVEVICT_PREBUILT_CORE")
        if not prebuilt:
            return super().build_extension(ext)
        if not os.path.isfile(prebuilt):
            raise RuntimeError(f"KVEVICT_PREBUILT_CORE={prebuilt} is not a file")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(prebuilt, target)


core = Pybind11Extension(
    "kvevict._core",
    sources,
    include_dirs=[include, find_cccl()],
    define_macros=[("KVEVICT_PYTHON_CUDA", "0")],
    cxx_std=17,
    extra_compile_args=["-O2", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(
    name="kvevict",
    version=project_version(),
    description="KV-cache eviction stages (SnapKV, H2O, TOVA, PyramidKV, AdaKV, LAVa, CAKE, Duo, ...) on "
    "PyTorch / NumPy tensors",
    packages=["kvevict"],
    package_dir={"kvevict": "kvevict"},
    ext_modules=[core],
    cmdclass={"build_ext": build_core},
    python_requires=">=3.9",
    zip_safe=False,
)
