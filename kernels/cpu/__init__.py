"""CPU kernels in C, built on first use with the system's C compiler.

`skinny_linear(x, weight, bias)` computes `x @ weight.T + bias` for 1 to 16
rows of fp32 (plain decoding and tree verification) reading each weight row
once, in the nn.Linear layout (kernels/cpu/skinny_gemm.c). Every output
element is computed the same way whatever the number of rows, so a token's
logits do not depend on how many tokens were verified with it. The weight
may also be float16 (converted in registers, fp32 arithmetic): half the
memory traffic, for drafts, whose weights need not be exact.

The shared library is compiled once per source version into
`<cache>/cpu-kernels/<digest>/` (`$SPECFLASH_CACHE`, as for the embedded
models) with `cc -O3 -mavx2 -mfma -mf16c -fopenmp`; compiling takes about a
second. `available()` is False, and callers keep their torch path, when the
CPU lacks AVX2/FMA/F16C, no compiler is found, the build fails (logged once), or
`SPECFLASH_CPU_KERNELS=0`.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("specflash.kernels")

SOURCE = Path(__file__).with_name("skinny_gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared"]
MAX_ROWS = 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


class CpuKernelError(RuntimeError):
    """The C kernels cannot be built or loaded here."""


def _cpu_has_avx2() -> bool:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return cap in ("AVX2", "AVX512")
    return all(f" {f}" in flags for f in ("fma", "avx2", "f16c"))


def library_path(source: Path = SOURCE) -> Path:
    from kernels.cache import cache_dir

    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "cpu-kernels" / digest / "libspecflash_cpu.so"


def build(force: bool = False, source: Path = SOURCE) -> Path:
    """Compile the library into the cache (atomically) and return its path. `source`: another
    version of the kernels' C source (bench/cpu_matmul.py `--baseline`), cached by its digest."""
    out = library_path(source)
    if out.is_file() and not force:
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise CpuKernelError("no C compiler (cc / gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CpuKernelError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        os.replace(tmp, out)              # concurrent builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _error
    if _tried:                     # every few-row matmul asks: no lock once it is settled
        return _lib
    with _lock:
        if not _tried:
            _lib, _error = _open()
            _tried = True
        return _lib


def _open() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECFLASH_CPU_KERNELS", "1") == "0":
        return None, "disabled by SPECFLASH_CPU_KERNELS=0"
    if not _cpu_has_avx2():
        return None, "this CPU lacks AVX2/FMA/F16C"
    try:
        lib = open_library(build())
    except (CpuKernelError, OSError) as e:
        log.warning("CPU kernels unavailable, using torch's matmul: %s", e)
        return None, str(e)
    return lib, None


def open_library(path: Path) -> ctypes.CDLL:
    """A built kernel library, its entry points declared (bench/cpu_matmul.py loads an earlier
    build beside this one with it)."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.sf_skinny_linear, lib.sf_skinny_linear_f16w):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  threads: int | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) for at most 16 rows, CPU; x, bias and the result
    float32, the weight float32 or float16.

    Raises CpuKernelError when the library is unavailable and ValueError for
    inputs it does not take (other dtypes or devices, more than MAX_ROWS rows).
    """
    lib = _load()
    if lib is None:
        raise CpuKernelError(f"CPU kernels unavailable: {_error}")
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    N = weight.shape[0]
    if not (x.dtype == torch.float32 and weight.dtype in (torch.float32, torch.float16)
            and x.device.type == weight.device.type == "cpu"):
        raise ValueError("skinny_linear takes CPU float32 inputs and a float32 or float16 weight")
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dimension {K}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {M}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,)):
        raise ValueError(f"bias must be float32 [{N}]")
    xc, wc = x.contiguous(), weight.contiguous()
    bc = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    fn = lib.sf_skinny_linear if weight.dtype == torch.float32 else lib.sf_skinny_linear_f16w
    fn(xc.data_ptr(), wc.data_ptr(), 0 if bc is None else bc.data_ptr(), y.data_ptr(),
                         M, K, N, threads or torch.get_num_threads())
    return y
