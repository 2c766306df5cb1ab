"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
at collection time, before any test module imports `kernels`.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
