"""CPU kernels in C, built on first use with the system's C compiler.

`skinny_linear(x, weight, bias)` computes `x @ weight.T + bias` for 1 to 16
rows of fp32 (plain decoding and tree verification) reading each weight row
once, in the nn.Linear layout (kernels/cpu/skinny_gemm.c). Every output
element is computed the same way whatever the number of rows, so a token's
logits do not depend on how many tokens were verified with it. The weight
may also be float16 (converted in registers, fp32 arithmetic): half the
memory traffic, or int8 with a scale per weight row: a quarter; for drafts,
whose weights need not be exact (int8 on AVX-512 where the CPU has it: 16 weights
an instruction, ~1.4x the AVX2 loop on a 576-wide draft's matmuls).

`panel_linear(x, panels, n, bias)` is the same product for a float32 weight
repacked once (`panel_pack`) into panels of 16 output columns
(kernels/cpu/panel_gemm.c): each row's outputs accumulate along k in
registers, so 5 to 8 rows cost ~20-30 % less than reading the nn.Linear layout,
with the same property (a row's result never depends on the others); on a CPU
with AVX-512 all 1 to 16 rows share one pass over the weights, with the same
bits as AVX2 (`panel_isa`).
`models.linear.PackedWeight` takes it for float32 weights.

`rms_norm`, `silu_mul`, `rope_store` and `tree_attention` are a decoder
layer's work between its matmuls in four calls instead of ~40 torch operators
(kernels/cpu/layer_ops.c), each row's result again independent of the others.
`decoder_layer` runs a whole layer of a forward of at most 16 rows (its four
matmuls and those operators, in the same order, the same bits) in one call
(kernels/cpu/decoder_layer.c), with what its layers share built once per
forward (`DecoderStep`); `visible_slots` lays out what each row of a forward
sees in one call, and `draft_chains` runs a greedy draft chain's levels in one
call (models/draft_chain.py). The decoder-layer half lives in
kernels/cpu/decoder.py.

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
LAYER_SOURCE = Path(__file__).with_name("layer_ops.c")
DECODER_SOURCE = Path(__file__).with_name("decoder_layer.c")
PANEL_SOURCE = Path(__file__).with_name("panel_gemm.c")
CUT_SOURCE = Path(__file__).with_name("sample_cut.c")
PANEL = 16                                        # output columns a panel (panel_gemm.c)
HEADER = Path(__file__).with_name("simd.h")     # included by both; an earlier --baseline source may not
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

    text = (source.read_bytes() + LAYER_SOURCE.read_bytes() + DECODER_SOURCE.read_bytes()
            + PANEL_SOURCE.read_bytes() + CUT_SOURCE.read_bytes() + HEADER.read_bytes() + " ".join(FLAGS).encode())
    digest = hashlib.sha256(text).hexdigest()[:16]
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
        proc = subprocess.run([cc, *FLAGS, f"-I{HEADER.parent}", str(source), str(LAYER_SOURCE),
                               str(DECODER_SOURCE), str(PANEL_SOURCE), str(CUT_SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
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
    lib.sf_panel_isa(0 if os.environ.get("SPECFLASH_CPU_AVX512", "1") == "0" else 1)
    return lib, None


def open_library(path: Path) -> ctypes.CDLL:
    """A built kernel library, its entry points declared (bench/cpu_matmul.py loads an earlier
    build beside this one with it)."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.sf_skinny_linear, lib.sf_skinny_linear_f16w):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    if hasattr(lib, "sf_skinny_linear_i8w"):   # an earlier build (bench/cpu_matmul.py --baseline) may lack it
        lib.sf_skinny_linear_i8w.restype = ctypes.c_int
        lib.sf_skinny_linear_i8w.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int,
                                                                                            ctypes.c_void_p]
    if hasattr(lib, "sf_rms_norm"):        # an earlier build (bench/cpu_matmul.py --baseline) may lack them
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        signatures = {"sf_rms_norm": [ptr] * 3 + [i64] * 2 + [ctypes.c_float],
                      "sf_silu_mul": [ptr] * 2 + [i64] * 2,
                      "sf_rope_store": [ptr] * 6 + [i64] * 4,
                      "sf_tree_attention": [ptr, i64] + [ptr] * 4 + [i64, ptr] + [i64] * 4
                                           + [ctypes.c_float, ptr, ctypes.c_int]}
        for name, args in signatures.items():
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = args
        if hasattr(lib, "sf_visible_slots"):   # an earlier build may lack it
            lib.sf_visible_slots.restype = ctypes.c_int
            lib.sf_visible_slots.argtypes = [ptr, i64, ptr, ptr] + [i64] * 5 + [ptr] * 3
        if hasattr(lib, "sf_gumbel_noise"):
            lib.sf_gumbel_noise.restype = lib.sf_coupled_top.restype = None
            lib.sf_gumbel_noise.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int]
            lib.sf_coupled_top.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, ctypes.c_int]
            lib.sf_sample_pick.restype = ctypes.c_int
            lib.sf_sample_pick.argtypes = [ptr, i64, i64] + [ptr] * 8
    if hasattr(lib, "sf_panel_linear"):
        lib.sf_panel_linear.restype = ctypes.c_int
        lib.sf_panel_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    if hasattr(lib, "sf_panel_isa"):
        lib.sf_panel_isa.restype = ctypes.c_int
        lib.sf_panel_isa.argtypes = [ctypes.c_int]
    if hasattr(lib, "sf_decoder_layer"):
        lib.sf_decoder_layer.restype = ctypes.c_int
        lib.sf_decoder_layer.argtypes = [ctypes.c_void_p] * 3
    if hasattr(lib, "sf_decoder_layers"):
        lib.sf_decoder_layers.restype = ctypes.c_int
        lib.sf_decoder_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    if hasattr(lib, "sf_draft_chains"):
        lib.sf_draft_chains.restype = ctypes.c_int
        lib.sf_draft_chains.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2
                                        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 8
                                        + [ctypes.c_int64] + [ctypes.c_void_p] * 24)
    return lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  threads: int | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) for at most 16 rows, CPU; x, bias and the result
    float32, the weight float32 or float16, or int8 with `scales` [N] float32 (weight row n
    stands for scales[n] * weight[n]).

    Raises CpuKernelError when the library is unavailable and ValueError for
    inputs it does not take (other dtypes or devices, more than MAX_ROWS rows).
    """
    lib = _load()
    if lib is None:
        raise CpuKernelError(f"CPU kernels unavailable: {_error}")
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    N = weight.shape[0]
    if not (x.dtype == torch.float32 and weight.dtype in (torch.float32, torch.float16, torch.int8)
            and x.device.type == weight.device.type == "cpu"):
        raise ValueError("skinny_linear takes CPU float32 inputs and a float32, float16 or int8 weight")
    if (weight.dtype == torch.int8) != (scales is not None):
        raise ValueError("an int8 weight takes scales (float32, one per weight row), and only it")
    if scales is not None and (scales.dtype != torch.float32 or scales.shape != (N,)):
        raise ValueError(f"scales must be float32 [{N}]")
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dimension {K}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {M}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,)):
        raise ValueError(f"bias must be float32 [{N}]")
    xc, wc = x.contiguous(), weight.contiguous()
    bc = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    args = (xc.data_ptr(), wc.data_ptr(), 0 if bc is None else bc.data_ptr(), y.data_ptr(), M, K, N,
            threads or torch.get_num_threads())
    if weight.dtype == torch.int8:
        lib.sf_skinny_linear_i8w(*args, scales.contiguous().data_ptr())
    else:
        (lib.sf_skinny_linear if weight.dtype == torch.float32 else lib.sf_skinny_linear_f16w)(*args)
    return y


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 → its panels [ceil(N / 16), K, 16]: panels[p, k, c] = weight[16 p + c, k],
    zeros past row N."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError("panel_pack takes a 2-D CPU float32 weight")
    N, K = weight.shape
    P = (N + PANEL - 1) // PANEL
    padded = torch.zeros(P * PANEL, K, dtype=torch.float32)
    padded[:N] = weight
    return padded.view(P, PANEL, K).transpose(1, 2).contiguous()


def _holds_panels(panels: torch.Tensor, n: int, K: int | None = None) -> bool:
    """Whether `panels` can be `panel_pack`'s of a float32 CPU weight [n, K] (any K where None)."""
    return (panels.dtype == torch.float32 and panels.device.type == "cpu" and panels.dim() == 3
            and panels.shape[2] == PANEL and (K is None or panels.shape[1] == K) and panels.is_contiguous()
            and max(0, (panels.shape[0] - 1) * PANEL) < n <= panels.shape[0] * PANEL)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
    """x [..., K] float32 (1 to 16 rows) @ the weight [n, K] that `panel_pack` made `panels` of,
    .T, + bias [n] → [..., n]."""
    lib = _load()
    if lib is None:
        raise CpuKernelError(f"CPU kernels unavailable: {_error}")
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and _holds_panels(panels, n, K)):
        raise ValueError(f"panel_linear takes CPU float32 x [..., {K}] and the panels of a [{n}, {K}] weight")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"panel_linear takes 1 to {MAX_ROWS} rows, got {M}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
        raise ValueError(f"bias must be float32 [{n}]")
    xc = x.contiguous()
    bc = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.sf_panel_linear(xc.data_ptr(), panels.data_ptr(), 0 if bc is None else bc.data_ptr(), y.data_ptr(), M, K, n,
                        threads or torch.get_num_threads())
    return y


def panel_isa(want: str | None = None) -> str:
    """The instruction set `panel_linear` (and the decoder layer's panels) and `skinny_linear` on
    int8 weights run on: "avx512" where the CPU has it, else "avx2"; `want` ("avx2" / "avx512")
    switches it for the calls that follow (AVX-512 only where the CPU has it;
    `SPECFLASH_CPU_AVX512=0` starts on AVX2). The panels give the same bits either way
    (kernels/cpu/panel_gemm.c); int8 weights, a draft's, other bits, each row's the same whatever
    the other rows (kernels/cpu/skinny_gemm.c)."""
    lib = _load()
    if lib is None:
        raise CpuKernelError(f"CPU kernels unavailable: {_error}")
    if want not in (None, "avx2", "avx512"):
        raise ValueError(f"panel_isa takes 'avx2' or 'avx512', not {want!r}")
    return "avx512" if lib.sf_panel_isa(-1 if want is None else int(want == "avx512")) else "avx2"


# The layer operators below take CPU float32 tensors (callers check `layer_ops_apply` once per
# forward); they check shapes, not dtypes, on the hot path.

def layer_ops_apply(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the C layer operators take this forward: CPU float32 inference, the library
    built, a head size that is a multiple of 8 up to 256."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= 256
            and not (torch.is_grad_enabled() and x.requires_grad) and _load() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] → weight * x / sqrt(mean(x²) + eps), row by row."""
    H = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    _load().sf_rms_norm(xc.data_ptr(), weight.data_ptr(), out.data_ptr(), xc.numel() // H, H, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] → silu(gate) * up [..., I]."""
    I2 = gate_up.shape[-1]
    gu = gate_up.contiguous()
    out = torch.empty(*gu.shape[:-1], I2 // 2, dtype=torch.float32)
    _load().sf_silu_mul(gu.data_ptr(), out.data_ptr(), gu.numel() // I2, I2 // 2)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> None:
    """RoPE on the q and k heads of qkv [N, (Hq + 2 Hkv) D] in place (cos, sin: N * D/2 values),
    then each row's k and v to its cache slot (k_cache, v_cache: [.., block_size, Hkv, D]
    contiguous; slots [N] int64)."""
    N = qkv.shape[0]
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous()
            and v_cache.is_contiguous() and cos.numel() == sin.numel() == N * head_dim // 2):
        raise ValueError("rope_store takes contiguous qkv, cos, sin and caches")
    sl = slots.contiguous()
    _load().sf_rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                       sl.data_ptr(), N, num_heads, num_kv_heads, head_dim)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                   counts: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D] (heads contiguous, rows evenly strided); k_cache, v_cache [.., Hkv, D]
    contiguous; visible [B * T, S] int64: the cache slots each row sees, in order, its first
    counts[r] entries valid → [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    R, S = visible.shape
    row = q.stride(1) if T > 1 else q.stride(0)
    if not (q.stride(3) == 1 and q.stride(2) == D and (B == 1 or q.stride(0) == T * row) and R == B * T
            and k_cache.is_contiguous() and v_cache.is_contiguous() and visible.is_contiguous()):
        raise ValueError("tree_attention: q needs contiguous heads and evenly strided rows, the rest contiguous")
    threads = torch.get_num_threads()
    out = torch.empty(B, T, Hq, D, dtype=torch.float32)
    scratch = torch.empty(max(threads, 1) * max(S, 1), dtype=torch.float32)
    _load().sf_tree_attention(q.data_ptr(), row, k_cache.data_ptr(), v_cache.data_ptr(), visible.data_ptr(),
                           counts.data_ptr(), S, out.data_ptr(), R, Hq, Hkv, D, scale, scratch.data_ptr(),
                           threads)
    return out


def visible_slots(block_tables: torch.Tensor, prefix_lens: torch.Tensor, tree_mask: torch.Tensor,
                  block_size: int, window: int | None, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each of a forward's B * T query rows sees, laid out for `tree_attention` in one call:
    block_tables [B, W] int32 (int64 is narrowed), prefix_lens [B], tree_mask [B, T, T] bool,
    `window` a sliding window or None, S >= max(prefix_lens) + T → (visible [B * T, S] int64,
    counts [B * T] int64, the slot each row is written to [B * T] int64)."""
    B, T = tree_mask.shape[0], tree_mask.shape[1]
    if S < (int(prefix_lens.max()) if B else 0) + T:
        raise ValueError(f"visible_slots: S = {S} is shorter than a row's prefix and tree")
    tables = block_tables.to(torch.int32).contiguous()
    lens = prefix_lens.to(torch.long).contiguous()
    mask = tree_mask.to(torch.bool).contiguous()
    vis = torch.empty(B * T, S, dtype=torch.long)
    counts = torch.empty(B * T, dtype=torch.long)
    rows = torch.empty(B * T, dtype=torch.long)
    if _load().sf_visible_slots(tables.data_ptr(), tables.shape[1], lens.data_ptr(), mask.data_ptr(), B, T, block_size,
                                window or 0, S, vis.data_ptr(), counts.data_ptr(), rows.data_ptr()) != 0:
        raise CpuKernelError("sf_visible_slots: out of memory for the window's scratch")
    return vis, counts, rows


def gumbel_noise(keys: torch.Tensor, vocab: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """keys [N] int64 (`models.sampling._position_keys`) → the Gumbel noise [N, V] float32 of
    tokens [V] int64 (0 .. vocab - 1 where None) at each key's position, as
    `models.sampling.gumbel_noise` defines it (the logarithms in C's double precision)."""
    keys = keys.long().contiguous()
    tokens = None if tokens is None else tokens.long().contiguous()
    V = vocab if tokens is None else tokens.shape[0]
    out = torch.empty(keys.shape[0], V, dtype=torch.float32)
    _load().sf_gumbel_noise(keys.data_ptr(), keys.shape[0], None if tokens is None else tokens.data_ptr(), V,
                            out.data_ptr(), torch.get_num_threads())
    return out


def coupled_top(probs: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor | None, k: int) -> torch.Tensor:
    """probs [N, V] float32 → log p + G [N, V] (G: `gumbel_noise` under keys [N]) where it can be
    among its row's k largest (1 <= k <= 16), -inf elsewhere: the same k largest, with the
    logarithms of a few tokens a row instead of all."""
    if not 1 <= k <= 16:
        raise ValueError(f"coupled_top keeps 1 to 16 a row, not {k}")
    probs, keys = probs.float().contiguous(), keys.long().contiguous()
    tokens = None if tokens is None else tokens.long().contiguous()
    if probs.dim() != 2 or keys.shape != (probs.shape[0],) or (tokens is not None and tokens.shape != probs.shape[1:]):
        raise ValueError("coupled_top: probs [N, V], keys [N], tokens [V] or None")
    out = torch.empty_like(probs)
    _load().sf_coupled_top(probs.data_ptr(), keys.data_ptr(), probs.shape[0],
                           None if tokens is None else tokens.data_ptr(), probs.shape[1], k, out.data_ptr(),
                           torch.get_num_threads())
    return out


def lay_cuts(cuts: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor] | None:
    """min-p, top-k and top-p as sample_cut.c reads them: float32, int64, float32, contiguous."""
    if cuts is None:
        return None
    return [c.to(dtype).contiguous() for c, dtype in zip(cuts, (torch.float32, torch.long, torch.float32))]


def sample_pick(logits: torch.Tensor, temps: torch.Tensor, noise: torch.Tensor,
                cuts: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft pass's draw (sf_sample_pick) on logits [N, V]: each row at temps [N] (0: greedy)
    with Gumbel noise [N, V], under `cuts` (min-p [N], top-k [N], top-p [N]; 0, 0, 1: none) →
    (index [N] int64, log q [N] float32, q [N, V] float32: the distribution each draw came from;
    a greedy row's is not written)."""
    logits, noise, temps = logits.float().contiguous(), noise.float().contiguous(), temps.float().contiguous()
    N, V = logits.shape
    if noise.shape != (N, V) or temps.shape != (N,) or (cuts is not None and any(c.shape != (N,) for c in cuts)):
        raise ValueError("sample_pick: logits and noise [N, V], temps and each cut [N]")
    cuts = lay_cuts(cuts)
    cut_ptrs = [None] * 3 if cuts is None else [c.data_ptr() for c in cuts]
    index, log_q, q = torch.empty(N, dtype=torch.long), torch.empty(N), torch.zeros(N, V)
    if _load().sf_sample_pick(logits.data_ptr(), N, V, temps.data_ptr(), noise.data_ptr(), index.data_ptr(),
                              log_q.data_ptr(), q.data_ptr(), *cut_ptrs):
        raise CpuKernelError("sf_sample_pick: no memory for a cut's scratch")
    return index, log_q, q


def gumbel_available() -> bool:
    lib = _load()
    return lib is not None and hasattr(lib, "sf_gumbel_noise")


# the whole-layer call and the chain call (kernels/cpu/decoder.py) need the loader above
from kernels.cpu.decoder import (DecoderStep, SfForward, SfLayer, SfWeight, decoder_layer_available,  # noqa: E402
                                 draft_chains, layer_operand, layer_table, panel_operand, weight_operand)

__all__ = ["CpuKernelError", "DecoderStep", "MAX_ROWS", "PANEL", "SOURCE", "SfForward", "SfLayer", "SfWeight",
           "available", "build", "coupled_top", "decoder_layer_available", "draft_chains", "gumbel_available",
           "gumbel_noise", "layer_operand", "layer_table",
           "layer_ops_apply", "library_path", "open_library", "panel_isa", "panel_linear", "panel_operand",
           "panel_pack", "rms_norm", "rope_store", "silu_mul", "skinny_linear", "tree_attention",
           "unavailable_reason", "visible_slots", "weight_operand"]
