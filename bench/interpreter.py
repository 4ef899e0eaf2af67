"""Triton's interpreter for a bench's --smoke run on a machine with no GPU."""

from __future__ import annotations

import os
from typing import Any


def use_interpreter() -> None:
    """TRITON_INTERPRET=1 (set before the first kernel module defines its kernels), with the loop bound fix
    tests/conftest.py applies (Triton 3.6 calls int() on a 1-element array, numpy >= 2.4 refuses)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
