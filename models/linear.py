"""The CPU float32 matmul of the models' linear layers (`Linear`, `PackedWeight`) and the draft
weights' low-precision copies (`use_draft_weights`).

A few rows (plain decoding, tree verification, drafting) go to the C kernels of
`kernels.cpu`, which read each weight once per call; more rows to oneDNN's prepacked
matmul; any other device or dtype to `F.linear`. `FP32_PANELS` and `_SKINNY_ROWS` are read at
each call (benchmarks and tests set them here); `DRAFT_WEIGHTS` is the drafts' default format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels


_MKLDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_SKINNY_ROWS = 16     # rows up to which kernels.cpu.skinny_linear takes a CPU fp32 matmul (beyond: oneDNN)


def few_row_limit(model) -> int | None:
    """Rows per forward up to which `model`'s matmuls take the few-row C kernel, on a CPU in
    fp32 where it is built: a forward of one row more costs ~30 % more at once (oneDNN),
    a step the planners' linear cost model cannot see. None where there is no such limit."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not cpu_kernels.available():
        return None
    return _SKINNY_ROWS


class PackedWeight:
    """The CPU fp32 matmul of a weight: a C kernel for few rows, else a oneDNN-prepacked copy.

    Up to 16 rows (plain decoding, tree verification, drafting) go to a C
    kernel that reads the weight once: `kernels.cpu.panel_linear` on a copy
    repacked into panels of 16 output columns (`FP32_PANELS`), or
    `kernels.cpu.skinny_linear` on the weight in place; either costs little
    more for 4 rows than for one (`python bench/cpu_matmul.py`), and its
    results for a row do not depend on the other rows. With `low` (drafts: their weights need not be
    exact) it reads a low-precision copy of the weight instead (`DRAFT_WEIGHTS`):
    float16, half the memory traffic, or int8 with a scale per row, a quarter,
    which also leaves more of the memory bandwidth to a target running beside
    the draft. Where that kernel cannot be built, or for more rows, the paths
    below apply (in fp32, on the weight rounded to the same values).

    MKL's sgemm repacks the whole weight on every call with few rows (a tree
    verify or a short prefill), which halves throughput on this kind of CPU;
    a weight packed once for oneDNN does not. With one thread, one row (plain
    decoding) stays on the dense GEMV, which is as fast, except for a very wide
    weight (the LM head), where `x @ weight.T` on a transposed copy is ~1.7x
    faster here; with more threads one row takes the packed path too (the GEMV
    barely uses the second core: a whole SmolLM2-135M decoding step was ~12%
    faster packed on 2 threads here). Costs a second (and for `transposed_gemv`,
    a third) copy of the weight.
    """

    def __init__(self, transposed_gemv: bool = False, low: str | None = None) -> None:
        self.transposed_gemv = transposed_gemv
        self.low = low                                 # None, "fp16" or "int8": the few-row kernel's copy
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None       # oneDNN layout, [out, in]
        self._transposed: torch.Tensor | None = None   # [in, out] contiguous
        self._low_key: tuple[int, int] | None = None
        self._low: tuple[torch.Tensor, torch.Tensor | None] | None = None   # `_few_row_copy`

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] @ weight [out, in].T + bias → [..., out]."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 1 <= rows <= _SKINNY_ROWS and _cpu_fp32_inference(x, weight) and cpu_kernels.available():
            copy, scales = self._few_row_copy(weight)
            if copy.dim() == 3:
                return cpu_kernels.panel_linear(x, copy, weight.shape[0], bias)
            return cpu_kernels.skinny_linear(x, copy, bias, scales=scales)
        fast = _MKLDNN_LINEAR and _cpu_fp32_inference(x, weight)
        one_thread = torch.get_num_threads() == 1
        if not fast or (rows == 1 and one_thread and not self.transposed_gemv) or rows == 0:
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._packed = self._transposed = None
            self._key = key
        if rows == 1 and one_thread:
            if self._transposed is None:
                self._transposed = weight.detach().t().contiguous()
            out = x @ self._transposed
            return out if bias is None else out + bias
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, bias, "none", [], "")

    def operand(self, weight: torch.Tensor, bias: torch.Tensor | None,
                few_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> "cpu_kernels.SfWeight":
        """The weight as the whole-layer C call reads it: the copy `matmul` reads for few rows
        (`few_rows`: `_few_row_copy(weight)`'s result, where the caller has it already)."""
        copy, scales = few_rows or self._few_row_copy(weight)
        if copy.dim() == 3:
            return cpu_kernels.panel_operand(copy, weight.shape[0], bias)
        return cpu_kernels.weight_operand(copy, bias, scales)

    def round_to(self, weight: torch.Tensor, fmt: str) -> None:
        """Round `weight` in place to `fmt`'s values (`low_precision`) and keep the copy the
        few-row kernel reads of it, made by that same rounding."""
        low, scales, values = low_precision(weight.detach(), fmt)
        with torch.no_grad():
            weight.copy_(values)
        self.low, self._low, self._low_key = fmt, (low, scales), (weight.data_ptr(), weight._version, fmt)

    def _few_row_copy(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the few-row kernels read, made again when the weight changes: the low-precision
        copy and its scales; else (float32) the weight's panels (`FP32_PANELS`) or the weight."""
        key = (weight.data_ptr(), weight._version, self.low or FP32_PANELS)
        if key != self._low_key:
            if self.low is not None:
                low, scales, _ = low_precision(weight.detach(), self.low)
                self._low = (low, scales)
            else:
                self._low = (cpu_kernels.panel_pack(weight.detach()) if FP32_PANELS else weight.detach(), None)
            self._low_key = key
        return self._low


DRAFT_WEIGHTS = "int8"   # what a CPU draft's few-row matmuls read (`use_draft_weights`)
FP32_PANELS = True       # float32 weights' few-row matmuls read panels (kernels.cpu.panel_linear), not the weight


def low_precision(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """weight [out, in] float32 in `fmt`: (the copy the few-row kernel reads: float16, or int8
    with one float32 scale per row (its absolute maximum / 127); those scales or None; the fp32
    values it stands for)."""
    if fmt == "fp16":
        low = weight.half()
        return low, None, low.float()
    if fmt == "int8":
        amax = weight.abs().amax(dim=1)
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float()
        q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return q, scales, q.float() * scales[:, None]
    raise ValueError(f"unknown draft weight format {fmt!r} (fp16 or int8)")


def use_draft_weights(model: nn.Module, fmt: str = DRAFT_WEIGHTS) -> None:
    """A draft's layers in low precision (`low_precision`): their weights are rounded to the
    format's values in place (so every path computes with the same numbers) and few-row CPU
    matmuls read the low-precision copies. The embeddings, norms and full LM head are left as
    they are; so are weights that are not CPU fp32 (a GPU draft runs its own dtype)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module._pack.round_to(module.weight, fmt)


def _cpu_fp32_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and weight.requires_grad)
    )


class Linear(nn.Linear):
    """nn.Linear that takes the prepacked oneDNN path on the CPU for multi-row inputs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pack = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [..., in] → [..., out]
        return self._pack.matmul(x, self.weight, self.bias)
