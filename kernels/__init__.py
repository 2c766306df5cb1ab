"""Triton kernels of specflash and their pure-torch references (DESIGN.md §5).

`kernels.tree_decode_attention` and `kernels.rejection_sample` always launch
Triton (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
`kernels.ref` holds the references of the same signatures, the CPU path.
Importing this package needs no GPU, and does not import Triton: the Triton
modules load on first use of their names, so CPU-only callers (the models'
reference path) never pay for it and TRITON_INTERPRET can still be chosen late.
"""
from importlib import import_module

from kernels import ref

_TRITON_NAMES = {
    "rejection_sample": "kernels.rejection",
    "tree_decode_attention": "kernels.tree_attention",
}

__all__ = ["ref", "rejection_sample", "tree_decode_attention"]


def __getattr__(name: str):
    module = _TRITON_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
