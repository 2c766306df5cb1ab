"""Triton kernels of specflash and their pure-torch references (DESIGN.md §5).

`kernels.tree_decode_attention` and `kernels.rejection_sample` always launch
Triton (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
`kernels.ref` holds the references of the same signatures, the CPU path.
Importing this package needs no GPU.
"""
from kernels import ref
from kernels.rejection import rejection_sample
from kernels.tree_attention import tree_decode_attention

__all__ = ["ref", "rejection_sample", "tree_decode_attention"]
