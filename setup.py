"""Build script. Native parts are optional: the package installs and imports without them.

The kernels are plain shared libraries (``csrc/``, C ABI, no torch headers) that
``sglang_kvxfer._native`` loads with ctypes, so building needs a C++ compiler (and nvcc for
the CUDA one) but never torch. The compiler commands live in
``sglang_kvxfer/_native/build.py``; this file only decides what to build:

* ``libkvxfer_cpu.so``: always tried; a failure is a warning (ops then use the torch
  reference, or build the library on first use if a compiler appears later).
* ``libkvxfer_cuda.so``: when ``nvcc`` is found (it compiles in a few seconds), unless
  ``KVXFER_BUILD_CUDA=0``; with ``KVXFER_BUILD_CUDA=1`` a failure fails the install. The
  build takes the nvcc of torch's CUDA major version where one is installed and then links
  the CUDA runtime shared (torch's libcudart), else static (see ``build.CudaToolchain``).
  Build with ``--no-build-isolation`` so the installed torch is visible.
"""

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # build.py and envs.py are stdlib-only; import them in place
from sglang_kvxfer import envs  # noqa: E402
from sglang_kvxfer._native import build as native_build  # noqa: E402


class NativeLibrary(Extension):
    """A plain shared library loaded with ctypes (not a CPython extension module)."""

    def __init__(self, name: str, kind: str):
        super().__init__(name, sources=[], optional=True)
        self.kind = kind


class BuildNative(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # libkvxfer_cpu.so, not libkvxfer_cpu.cpython-311-x86_64-linux-gnu.so
        return str(Path(*fullname.split("."))) + ".so"

    def build_extension(self, ext) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            if ext.kind == "cpu":
                native_build.build_cpu(out)
            else:
                archs = envs.KVXFER_CUDA_ARCHS.get().split(",")
                toolchain = native_build.cuda_toolchain()
                if toolchain is not None:
                    print(f"sglang_kvxfer: building {out.name} with {toolchain.describe()}")
                native_build.build_cuda(out, archs, toolchain=toolchain)
        except native_build.BuildError as exc:
            if ext.kind == "cuda" and envs.KVXFER_BUILD_CUDA.get() == "1":
                raise
            print(
                f"WARNING: sglang_kvxfer: {out.name} was not built; ops fall back to the torch reference.\n{exc}",
                file=sys.stderr,
            )
            return
        print(f"sglang_kvxfer: built {out}")

    def run(self) -> None:
        super().run()
        if not self.inplace:
            # A wheel carries the sources so a missing library can be built on first use.
            dest = Path(self.build_lib) / "sglang_kvxfer" / "_native" / "csrc"
            dest.mkdir(parents=True, exist_ok=True)
            for name in native_build.SOURCES:
                shutil.copy2(ROOT / "csrc" / name, dest / name)


def native_libraries() -> list:
    libs = [NativeLibrary("sglang_kvxfer._native.libkvxfer_cpu", "cpu")]
    mode = envs.KVXFER_BUILD_CUDA.get()
    if mode == "1" or (mode == "auto" and native_build.find_nvcc()):
        libs.append(NativeLibrary("sglang_kvxfer._native.libkvxfer_cuda", "cuda"))
    return libs


setup(ext_modules=native_libraries(), cmdclass={"build_ext": BuildNative})
