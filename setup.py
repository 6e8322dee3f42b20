"""Builds native/ (C++ CPU expert kernels, pybind11, no torch linkage) when a compiler is present.

Without a compiler the build is skipped and engine falls back to torch with one warning."""
import os
import sys

from setuptools import setup

# setuptools.build_meta does not put the project root on sys.path; native/build.py lives there.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ext_modules = []
cmdclass = {}
try:
    from native.build import extension_and_cmdclass  # noqa: E402
except ImportError:
    pass
else:
    ext_modules, cmdclass = extension_and_cmdclass()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
