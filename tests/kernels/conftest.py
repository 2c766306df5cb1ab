"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

Triton decides when it is imported (and when each `@triton.jit` function is
decorated) whether to interpret, so TRITON_INTERPRET=1 must be set before the
first `import triton` of the process. It is set here, which is early enough
when pytest starts in this folder. A whole-suite run may import triton earlier
(through another folder's tests), so scripts/test.sh, the CI entry, exports
TRITON_INTERPRET=1 up front; a run that misses it fails here with that advice
instead of with Triton's "Pointer argument cannot be accessed" errors.
"""
import os
import sys

import pytest

_TRITON_WAS_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _triton_interpreter():
    if _TRITON_WAS_COMPILED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: run "
                    "`TRITON_INTERPRET=1 pytest ...` (as scripts/test.sh does) or pytest tests/kernels alone")
