"""Triton's interpreter (3.6) turns a scalar loaded from memory into a one-element array, which numpy 2
refuses to use as a loop bound (`range(0, n, BLOCK)` with `n = tl.load(ptr)`); compiled kernels take it as
a scalar. This makes the interpreter do the same. Test-only: nothing in the engine imports it."""
from __future__ import annotations


def patch_interpreter() -> None:
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # no triton: the kernel tests skip themselves
        return
    if getattr(interp, "_killick_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._killick_patched = True
