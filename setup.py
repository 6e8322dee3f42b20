"""Builds native/ (C++ CPU expert kernels, pybind11, no torch linkage) when a compiler is present.

Without a compiler the build is skipped and engine falls back to torch with one warning."""
from setuptools import setup

ext_modules = []
cmdclass = {}
try:
    from native.build import extension_and_cmdclass  # noqa: E402  (filled in by native/)
except ImportError:
    pass
else:
    ext_modules, cmdclass = extension_and_cmdclass()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
