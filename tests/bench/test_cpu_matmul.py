"""bench/cpu_matmul.py: the few-row kernels and the layer operators against torch, and another build."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu
from models import linear


@pytest.mark.skipif(not cpu.available(), reason="the C kernel needs AVX2/FMA/F16C and a C compiler")
def test_times_each_path_and_a_baseline_build_and_restores_the_kernel(tiny_target, bench_script, capsys):
    lib, isa = cpu._load(), cpu.panel_isa()
    assert bench_script("cpu_matmul").main(["--target", str(tiny_target), "--rows", "1", "3", "--reps", "1",
                                            "--baseline", str(cpu.SOURCE)]) == 0
    out = capsys.readouterr().out.splitlines()
    paths = {"torch", "C-layer", "C-decoder", "C-panels", "baseline"} | ({"C-panels-512"} if isa == "avx512" else set())
    rows = {line.split()[0]: line for line in out if line.split() and line.split()[0] in paths | {"C-panels-512"}}
    assert set(rows) == paths            # AVX-512 panels beside AVX2's where the CPU has them
    assert all("1 rows" in line and "3 rows" in line for line in rows.values())
    assert cpu._load() is lib            # the project's build is the one loaded again
    assert cpu.panel_isa() == isa        # on the instruction set it ran on before
    assert cpu.layer_ops_apply(torch.zeros(1, 8), 8)     # and the layer operators switched on again
    assert cpu.decoder_layer_available() and linear.FP32_PANELS   # a layer in one call, panels
