"""kernels.cpu.skinny_linear and panel_linear: the C few-row matmuls every CPU decoding /
verification step takes (the weight in place, or repacked into panels of 16 columns, on AVX2 or,
where the CPU has it, AVX-512)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu

ROOT = Path(__file__).resolve().parents[2]
CAN_BUILD = cpu._cpu_has_avx2() and (shutil.which("cc") or shutil.which("gcc")) is not None
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs an AVX2/FMA CPU and a C compiler")
HAS_AVX512 = " avx512f" in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else "")


def test_builds_and_loads_here():
    # where it can be built it must be: a silent fallback would hide a broken kernel
    assert cpu.available(), cpu.unavailable_reason()


def _fp32_product(layout: str, w: torch.Tensor):
    """x, bias, threads -> x @ w.T + bias through the kernel of `layout` ("panels-avx2": the
    panels on AVX2 where the CPU would take AVX-512)."""
    if layout == "rows":
        return lambda x, b=None, threads=None: cpu.skinny_linear(x, w, b, threads=threads)
    panels = cpu.panel_pack(w)

    def product(x, b=None, threads=None):
        isa = cpu.panel_isa()
        if layout == "panels-avx2":
            cpu.panel_isa("avx2")
        try:
            return cpu.panel_linear(x, panels, w.shape[0], b, threads=threads)
        finally:
            cpu.panel_isa(isa)
    return product


@pytest.mark.parametrize("K", [8, 24, 37, 576, 1536])
@pytest.mark.parametrize("N", [1, 5, 64, 131])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["rows", "panels", "panels-avx2"])
def test_matches_float64_reference(K, N, threads, layout):
    g = torch.Generator().manual_seed(K * 1000 + N)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    product = _fp32_product(layout, w)
    for M in range(1, cpu.MAX_ROWS + 1):
        x = torch.randn(M, K, generator=g)
        ref = x.double() @ w.double().T
        got = product(x, None, threads)
        assert got.shape == (M, N) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-4 * K ** 0.5, rtol=1e-5)
        got_b = product(x, b, threads)
        torch.testing.assert_close(got_b.double(), ref + b.double(), atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("K", [16, 37, 576])
def test_float16_weights_compute_in_float32(K):
    g = torch.Generator().manual_seed(K)
    w = torch.randn(70, K, generator=g).half()
    b = torch.randn(70, generator=g)
    for M in (1, 3, 4, 5, 8, 13, 16):
        x = torch.randn(M, K, generator=g)
        ref = x.double() @ w.double().T + b.double()
        for threads in (1, 2):
            got = cpu.skinny_linear(x, w, b, threads=threads)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), ref, atol=1e-4 * K ** 0.5, rtol=1e-5)
    # the same numbers as the fp32 kernel on the same (fp16-valued) weight
    x = torch.randn(4, K, generator=g)
    assert torch.equal(cpu.skinny_linear(x, w, b), cpu.skinny_linear(x, w.float(), b))


ISAS = ["avx2", "avx512"] if HAS_AVX512 else ["avx2"]


@pytest.fixture
def isa(request):
    """The instruction set the kernels take for the test (`panel_isa`), given back after."""
    before = cpu.panel_isa()
    cpu.panel_isa(request.param)
    yield request.param
    cpu.panel_isa(before)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("K", [16, 37, 48, 576])
def test_int8_weights_with_row_scales(K, isa):
    g = torch.Generator().manual_seed(K)
    q = torch.randint(-127, 128, (70, K), generator=g, dtype=torch.int8)
    scales = torch.rand(70, generator=g) * 0.01 + 1e-4
    b = torch.randn(70, generator=g)
    w = q.double() * scales.double()[:, None]
    for M in (1, 3, 4, 5, 8, 16):
        x = torch.randn(M, K, generator=g)
        for threads in (1, 2):
            got = cpu.skinny_linear(x, q, b, threads=threads, scales=scales)
            torch.testing.assert_close(got.double(), x.double() @ w.T + b.double(), atol=1e-4 * K ** 0.5, rtol=1e-5)
    with pytest.raises(ValueError, match="scales"):
        cpu.skinny_linear(x, q, b)
    with pytest.raises(ValueError, match="scales"):
        cpu.skinny_linear(x, q.float(), b, scales=scales)


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_drafts_round_their_layers_and_read_low_precision_copies(fmt):
    from models.linear import Linear, low_precision, use_draft_weights

    net = torch.nn.Sequential(Linear(24, 40), Linear(40, 8, bias=False))
    before = [m.weight.detach().clone() for m in net]
    use_draft_weights(net, fmt)
    for m, w in zip(net, before):
        assert m._pack.low == fmt and torch.equal(m.weight, low_precision(w, fmt)[2])
        assert (m.weight - w).abs().max() <= w.abs().max() * (1e-3 if fmt == "fp16" else 1 / 254 + 1e-6)
    x = torch.randn(3, 24)
    with torch.inference_mode():
        few = net(x)                                       # the low-precision kernel
        many = net(x.repeat(6, 1))[:3]                     # 18 rows: torch's fp32 path, on the rounded values
    torch.testing.assert_close(few, many, atol=1e-5, rtol=1e-5)
    assert net[0]._pack._low[0].dtype == (torch.float16 if fmt == "fp16" else torch.int8)
    with pytest.raises(ValueError, match="unknown draft weight format"):
        low_precision(before[0], "int4")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_an_int8_row_does_not_depend_on_its_neighbours_or_threads(isa):
    """A draft's int8 rows (on AVX-512 other bits than on AVX2, the same whatever M and threads)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (300, 584), generator=g, dtype=torch.int8)
    scales = torch.rand(300, generator=g) * 0.01 + 1e-4
    b = torch.randn(300, generator=g)
    x = torch.randn(cpu.MAX_ROWS, 584, generator=g)
    full = cpu.skinny_linear(x, q, b, threads=1, scales=scales)
    for m in range(1, cpu.MAX_ROWS + 1):
        assert torch.equal(cpu.skinny_linear(x[:m], q, b, threads=1, scales=scales), full[:m])
        assert torch.equal(cpu.skinny_linear(x[m - 1:m], q, b, threads=2, scales=scales), full[m - 1:m])


@pytest.mark.parametrize("layout", ["rows", "panels", "panels-avx2"])
def test_a_row_does_not_depend_on_its_neighbours_or_threads(layout):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g)
    b = torch.randn(300, generator=g)
    x = torch.randn(cpu.MAX_ROWS, 576, generator=g)
    product = _fp32_product(layout, w)
    full = product(x, b, 1)
    for m in range(1, cpu.MAX_ROWS + 1):
        assert torch.equal(product(x[:m], b, 1), full[:m])
        assert torch.equal(product(x[m - 1:m], b, 2), full[m - 1:m])
    assert torch.equal(product(x[5:8], b, 2), full[5:8])


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512: the panels run on AVX2 only")
def test_avx512_panels_give_avx2s_bits():
    # one pass for every row and several panels at once (panel_gemm.c), the same sequence of
    # operations per output: a verification's bits do not depend on which CPU path ran it
    assert cpu.panel_isa() == "avx512"
    g = torch.Generator().manual_seed(3)
    for N, K in [(5, 24), (131, 37), (300, 576), (49 * 16 + 3, 64)]:  # partial last panels, leftovers
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g)
        on = {layout: _fp32_product(layout, w) for layout in ("panels", "panels-avx2")}
        for M in range(1, cpu.MAX_ROWS + 1):
            x = torch.randn(M, K, generator=g)
            for bias in (None, b):
                for threads in (1, 2):
                    got = {layout: f(x, bias, threads) for layout, f in on.items()}
                    assert torch.equal(got["panels"], got["panels-avx2"]), (N, K, M, threads)
                    assert torch.equal(got["panels"].view(torch.int32), got["panels-avx2"].view(torch.int32))
    assert cpu.panel_isa() == "avx512"          # the products put the default back
    with pytest.raises(ValueError, match="'avx2' or 'avx512'"):
        cpu.panel_isa("sse")


def test_leading_dimensions_and_strided_input():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 3, 128, generator=g)[..., ::2]          # [2, 3, 64], not contiguous
    got = cpu.skinny_linear(x, w)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-5)


def test_refuses_what_it_does_not_take():
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match=f"1 to {cpu.MAX_ROWS} rows"):
        cpu.skinny_linear(torch.randn(cpu.MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="float32"):
        cpu.skinny_linear(torch.randn(2, 16, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="float32"):
        cpu.skinny_linear(torch.randn(2, 16), w.bfloat16())
    with pytest.raises(ValueError, match="does not match"):
        cpu.skinny_linear(torch.randn(2, 8), w)
    with pytest.raises(ValueError, match="bias"):
        cpu.skinny_linear(torch.randn(2, 16), w, torch.randn(5))


def test_panels_refuse_what_they_do_not_take():
    w = torch.randn(20, 16)
    panels = cpu.panel_pack(w)
    assert panels.shape == (2, 16, 16) and torch.equal(panels[1, :, 4:], torch.zeros(16, 12))
    with pytest.raises(ValueError, match="2-D CPU float32"):
        cpu.panel_pack(w.double())
    with pytest.raises(ValueError, match=f"1 to {cpu.MAX_ROWS} rows"):
        cpu.panel_linear(torch.randn(cpu.MAX_ROWS + 1, 16), panels, 20)
    with pytest.raises(ValueError, match="panels of a \\[33, 16\\] weight"):   # 33 rows need 3 panels
        cpu.panel_linear(torch.randn(2, 16), panels, 33)
    with pytest.raises(ValueError, match="panels of a"):
        cpu.panel_linear(torch.randn(2, 8), panels, 20)
    with pytest.raises(ValueError, match="bias"):
        cpu.panel_linear(torch.randn(2, 16), panels, 20, torch.randn(5))


@pytest.mark.parametrize("panels", [True, False])
def test_linear_layers_take_it_for_few_rows_and_fall_back_beyond(monkeypatch, panels):
    from models import linear as transformer

    calls = []
    kernel = "panel_linear" if panels else "skinny_linear"
    real = getattr(cpu, kernel)
    monkeypatch.setattr(transformer, "FP32_PANELS", panels)
    monkeypatch.setattr(cpu, kernel, lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    lin = transformer.Linear(32, 16)
    with torch.inference_mode():
        few, many = torch.randn(1, 4, 32), torch.randn(1, transformer._SKINNY_ROWS + 1, 32)
        torch.testing.assert_close(lin(few), torch.nn.functional.linear(few, lin.weight, lin.bias))
        torch.testing.assert_close(lin(many), torch.nn.functional.linear(many, lin.weight, lin.bias))
    assert calls == [torch.Size([1, 4, 32])]


def test_disabled_or_unbuildable_falls_back_with_a_reason(tmp_path):
    code = ("from kernels import cpu; import torch; from models.linear import Linear;"
            "lin = Linear(8, 4); y = lin(torch.randn(2, 8));"
            "print(cpu.available(), '|', cpu.unavailable_reason(), '|', tuple(y.shape))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECFLASH_CACHE": str(tmp_path / "cache")}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "SPECFLASH_CPU_KERNELS": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert off.strip() == "False | disabled by SPECFLASH_CPU_KERNELS=0 | (2, 4)"
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "CC": "/bin/false"},
                         capture_output=True, text=True, check=True)
    assert bad.stdout.startswith("False | /bin/false failed") and bad.stdout.strip().endswith("(2, 4)")
    assert "CPU kernels unavailable" in bad.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))        # a failed build leaves nothing behind
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ok.stdout.strip() == "True | None | (2, 4)"
    isa = "from kernels import cpu; print(cpu.panel_isa())"
    avx2 = subprocess.run([sys.executable, "-c", isa], env={**env, "SPECFLASH_CPU_AVX512": "0"},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert avx2 == "avx2"
    default = subprocess.run([sys.executable, "-c", isa], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.strip() == ("avx512" if HAS_AVX512 else "avx2")
    assert len(list((tmp_path / "cache").rglob("libspecflash_cpu.so"))) == 1
