"""Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) on numpy >= 2.3: a loop bound read at
run time (``range(0, K, BLOCK)``) is a one-element array, and ``int()`` of it raises there. This
makes the interpreter's scalar ``__index__`` take the element. Applied by the kernel modules when
the interpreter is on; the GPU path does not use it."""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_exact_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._exact_fixed = True
    interpreter._patch_lang_tensor = patched
