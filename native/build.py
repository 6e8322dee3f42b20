"""Build recipe for native/_cpu_experts (imported by the root setup.py).

The generic code (pool, job planning, binding, scalar kernels) is compiled with baseline flags; each ISA's
kernels live in their own translation unit compiled with that ISA's flags, so the .so loads on any x86-64
and picks a path at run time. No compiler, no pybind11 or a failed compile: no extension, and the package
still installs (engine/experts/cpu_kernels.py then falls back to torch with one warning).
"""
from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension
from setuptools.command.build_ext import build_ext

SRC = os.path.join("native", "src")
GENERIC = ["module.cpp", "pool.cpp", "moe.cpp", "kernel_scalar.cpp"]
HEADERS = ["kernels.h", "kernel_impl.h", "pool.h", "moe.h", "runner.h", "job_threads.h", "kernel_avx512.cpp"]
BASE_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno"]
# GCC 12's AVX-512 headers warn about their own _mm512_undefined_*() helpers. -ffp-contract=off: the scalar tails
# of the row dots stay a multiply then an add in every walk; GCC's default contracted them into FMAs in some
# template instances and not others, so on the box's AVX-512 a row's bits depended on the walk a claim's size
# chose for it (a claim of 7 rows: its last row through the two-stream walk, 6e-8 apart).
ISA_EXTRA = ["-fPIC", "-Wno-uninitialized", "-Wno-maybe-uninitialized", "-ffp-contract=off"]
# (name, source, flags); the name becomes KILLICK_HAVE_<NAME> for runner.h's dispatch table.
ISA_UNITS = [
    ("avx2", "kernel_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"]),
    ("avx512", "kernel_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"]),
    ("avx512bf16", "kernel_avx512bf16.cpp",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mavx2"]),
    ("amx", "kernel_amx.cpp",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mavx2", "-mamx-tile",
      "-mamx-bf16"]),
]


def _warn(msg: str) -> None:
    print(f"killick native build: {msg}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that compiles the ISA units with their own flags and never fails the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (DistutilsPlatformError) or anything else
            _warn(f"skipped ({exc}); the torch fallback will be used")

    def build_extension(self, ext: Extension) -> None:
        try:
            if self.compiler.compiler_type != "unix":
                raise RuntimeError(f"compiler {self.compiler.compiler_type!r} is not supported")
            self._compile_isa_units(ext)
            super().build_extension(ext)
        except Exception as exc:
            _warn(f"extension {ext.name} not built ({exc}); the torch fallback will be used")

    def _compile_isa_units(self, ext: Extension) -> None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return
        for name, source, flags in ISA_UNITS:
            try:
                objects = self.compiler.compile(
                    [os.path.join(SRC, source)], output_dir=self.build_temp,
                    include_dirs=ext.include_dirs, extra_postargs=BASE_FLAGS + ISA_EXTRA + flags,
                    depends=ext.depends)
            except Exception as exc:
                _warn(f"{name} kernels not built ({exc})")
                continue
            ext.extra_objects.extend(objects)
            ext.define_macros.append((f"KILLICK_HAVE_{name.upper()}", "1"))


def extension_and_cmdclass() -> tuple[list[Extension], dict]:
    try:
        import pybind11
    except ImportError:
        _warn("pybind11 is missing; skipping the native extension")
        return [], {}
    ext = Extension(
        "native._cpu_experts",
        sources=[os.path.join(SRC, s) for s in GENERIC],
        depends=[os.path.join(SRC, h) for h in HEADERS] + [os.path.join(SRC, s) for _, s, _ in ISA_UNITS],
        include_dirs=[pybind11.get_include(), SRC],
        extra_compile_args=BASE_FLAGS,
        language="c++",
    )
    return [ext], {"build_ext": OptionalBuildExt}
