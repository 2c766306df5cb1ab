"""kernels.cpu's layer operators (kernels/cpu/layer_ops.c): RMSNorm, SiLU·up, RoPE with the cache
write, and the models' CPU fp32 forward that takes them. The tree attention itself is checked
against float64 through `CpuAttentionContext` in test_tree_attention.py."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from models import linear, transformer
from models.loader import load_model
from models.transformer import apply_rope, causal_mask, rms_norm
from models.tree import ancestor_mask

CAN_BUILD = cpu._cpu_has_avx2() and (shutil.which("cc") or shutil.which("gcc")) is not None
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs an AVX2/FMA CPU and a C compiler")


@pytest.mark.parametrize("H", [8, 37, 576])
def test_rms_norm_matches_torch(H):
    g = torch.Generator().manual_seed(H)
    x, w = torch.randn(5, H, generator=g) * 3, torch.randn(H, generator=g)
    got = cpu.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    # each row alone gives the same bits as among others
    assert torch.equal(cpu.rms_norm(x[3:4], w, 1e-5), got[3:4])


@pytest.mark.parametrize("I", [5, 64, 1536])
def test_silu_mul_matches_torch_over_the_whole_range(I):
    g = torch.Generator().manual_seed(I)
    gate_up = torch.randn(3, 2 * I, generator=g) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])[: min(4, I)]   # exp's under- and overflow
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu.silu_mul(gate_up)
    assert got.shape == (3, I) and not got.isnan().any()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_rope_store_rotates_q_and_k_and_writes_k_and_v_to_their_slots():
    N, Hq, Hkv, D, page = 3, 4, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (Hq + 2 * Hkv) * D, generator=g)
    angles = torch.randn(N, 1, D // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = torch.zeros(4, page, Hkv, D), torch.zeros(4, page, Hkv, D)
    slots = torch.tensor([9, 30, 2])
    want = apply_rope(qkv[:, : (Hq + Hkv) * D].view(N, Hq + Hkv, D), cos, sin)
    v = qkv[:, (Hq + Hkv) * D:].reshape(N, Hkv, D).clone()
    got = qkv.clone()
    cpu.rope_store(got, cos, sin, k_cache, v_cache, slots, Hq, Hkv, D)
    torch.testing.assert_close(got[:, : (Hq + Hkv) * D].view(N, Hq + Hkv, D), want, rtol=1e-6, atol=1e-6)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    torch.testing.assert_close(flat_k[slots], want[:, Hq:])
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    with pytest.raises(ValueError, match="contiguous"):
        cpu.rope_store(got[:, ::2], cos, sin, k_cache, v_cache, slots, Hq, Hkv, D // 2)


def _prefilled(model, ids, P):
    cache = model.new_cache(32, block_size=8)
    cache.add_sequence(0)
    model.forward(ids[:, :P], torch.arange(P)[None], cache, [0], causal_mask(1, P))
    return cache


def test_a_paths_logits_are_the_same_bits_in_any_tree_and_decoded_alone(tiny_target):
    """What exactness leans on: verifying a path inside a tree gives the bits of decoding it
    token by token (matmuls, norms and attention all row-independent)."""
    model = load_model(tiny_target)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    P = 24
    with torch.inference_mode():
        cache = _prefilled(model, ids, P)
        alone = torch.cat([model.forward(ids[:, P + i:P + i + 1], torch.tensor([[P + i]]), cache, [0],
                                         causal_mask(1, 1)) for i in range(4)], dim=1)
        # a tree whose path 0 → 2 → 3 → 5 is ids[P:P+4], with decoys beside it
        parents = torch.tensor([-1, 0, 0, 2, 2, 3])
        tokens = torch.tensor([[ids[0, P], 7, ids[0, P + 1], ids[0, P + 2], 9, ids[0, P + 3]]])
        positions = torch.tensor([[P, P + 1, P + 1, P + 2, P + 2, P + 3]])
        cache = _prefilled(model, ids, P)
        tree = model.forward(tokens, positions, cache, [0], ancestor_mask(parents)[None])
    assert torch.equal(tree[0, [0, 2, 3, 5]], alone[0])


def test_the_fused_cpu_layer_matches_the_torch_layer(tiny_target, monkeypatch):
    model = load_model(tiny_target)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(2))
    calls = []
    real = cpu.rope_store
    monkeypatch.setattr(cpu, "rope_store", lambda *a: calls.append(1) or real(*a))

    def run():
        with torch.inference_mode():
            cache = model.new_cache(32, block_size=8)
            for s in (0, 1):
                cache.add_sequence(s)
            # a prompt of 20 rows (more than the few-row matmul takes), then a step of 3
            first = model.forward(ids[:, :20], torch.arange(20).expand(2, 20), cache, [0, 1], causal_mask(2, 20))
            step = model.forward(ids[:, 20:23], torch.arange(20, 23).expand(2, 3), cache, [0, 1],
                                 causal_mask(2, 3))
        return first, step

    fused = run()
    assert calls, "the CPU fp32 forward did not take the C layer operators"
    monkeypatch.setattr(transformer.cpu_kernels, "layer_ops_apply", lambda *a: False)
    calls.clear()
    plain = run()
    assert not calls
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_layer_ops_apply_only_to_cpu_float32_inference_with_a_fitting_head_size():
    x = torch.randn(2, 8)
    assert cpu.layer_ops_apply(x, 64)
    assert not cpu.layer_ops_apply(x, 12)           # not a multiple of 8
    assert not cpu.layer_ops_apply(x, 264)          # wider than the kernel's registers
    assert not cpu.layer_ops_apply(x.double(), 64)
    assert not cpu.layer_ops_apply(x.bfloat16(), 64)


def _random_model(**overrides):
    from models.config import ModelConfig
    from models.transformer import Transformer

    c = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=256, **overrides)
    model = Transformer(c)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _packed_step(model, seed: int):
    """Two groups of different lengths (a 3-node tree beside a 1-row decode, after prompts of 13
    and 30 tokens): the hidden states of the step, [3 + 1, hidden]."""
    from models.transformer import PackedInput

    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        cache = model.new_cache(16, block_size=8)
        for s, P in ((0, 13), (1, 30)):
            cache.add_sequence(s)
            model.forward(torch.randint(3, 300, (1, P), generator=g), torch.arange(P)[None], cache, [s],
                          causal_mask(1, P))
        tree = PackedInput([0], torch.tensor([[4, 9, 11]]), torch.tensor([[13, 14, 14]]),
                           ancestor_mask(torch.tensor([-1, 0, 0]))[None])
        decode = PackedInput([1], torch.tensor([[7]]), torch.tensor([[30]]), causal_mask(1, 1))
        return model.forward_packed([tree, decode], cache)


def _layer_calls(monkeypatch) -> list[tuple[int, int | None]]:
    """The (start, stop) of every `DecoderStep.layers` call from now on."""
    calls = []
    real = cpu.DecoderStep.layers

    def counted(self, table, h, start=0, stop=None):
        calls.append((start, stop))
        return real(self, table, h, start, stop)
    monkeypatch.setattr(cpu.DecoderStep, "layers", counted)
    return calls


@pytest.mark.parametrize("overrides,draft_weights", [
    ({}, None),
    ({"arch": "mistral", "sliding_window": 6, "window_layers": [0, 2]}, None),
    ({"attention_bias": True, "attention_out_bias": True, "mlp_bias": True}, None),
    ({}, "int8"),
    ({}, "fp16"),
])
def test_a_whole_layer_in_one_c_call_gives_the_bits_of_its_steps_from_python(overrides, draft_weights, monkeypatch):
    """kernels/cpu/decoder_layer.c runs the layer's steps in one call; a forward of two groups
    (a tree and a decode), with sliding-window layers, biases or low-precision draft weights,
    gives exactly the hidden states of the same steps called one by one."""
    model = _random_model(**overrides)
    if draft_weights:
        linear.use_draft_weights(model, draft_weights)
    steps = _layer_calls(monkeypatch)
    whole = _packed_step(model, 3)
    # the 13-token prompt and the 4-row step (not the 30-token prompt): one C call for all 3 layers each
    assert steps == [(0, 3)] * 2, "the few-row forwards did not run their layers in one C call each"
    monkeypatch.setattr(transformer.cpu_kernels, "decoder_layer_available", lambda: False)
    steps.clear()
    one_by_one = _packed_step(model, 3)
    assert not steps
    assert torch.equal(whole, one_by_one)


@pytest.mark.parametrize("feature_layers", [(0,), (1, 2), (0, 1, 2)])
def test_feature_layers_split_the_one_call_and_keep_its_bits(feature_layers, monkeypatch):
    """A target whose features an EAGLE-3 head reads returns the outputs of some layers beside
    its final state: the C call stops after each of them (the last layer's included) and the
    states are those of the steps called one by one."""
    model = _random_model()
    model.set_feature_layers(feature_layers)
    runs = _layer_calls(monkeypatch)
    whole = _packed_step(model, 4)
    stops = sorted({i + 1 for i in feature_layers} | {3})
    assert runs == [(a, b) for a, b in zip([0] + stops[:-1], stops)] * 2
    monkeypatch.setattr(transformer.cpu_kernels, "decoder_layer_available", lambda: False)
    one_by_one = _packed_step(model, 4)
    assert whole.shape[-1] == (len(feature_layers) + 1) * 64 and torch.equal(whole, one_by_one)


def test_the_whole_layer_call_follows_its_weights_and_its_cache(monkeypatch):
    """A layer's C operand is kept while what it points into stays; changed in place, replaced,
    or read from another cache, the whole-layer call computes with the new values (the bits of
    the steps called one by one)."""
    model = _random_model(attention_bias=True)

    def both():
        with_c = _packed_step(model, 3)
        monkeypatch.setattr(transformer.cpu_kernels, "decoder_layer_available", lambda: False)
        without = _packed_step(model, 3)
        monkeypatch.undo()
        return with_c, without

    first, _ = both()
    layer = model.layers[1]
    with torch.no_grad():
        changes = [lambda: layer.mlp_norm.mul_(1.5),
                   lambda: layer.o_proj.weight.mul_(-1.0),
                   lambda: setattr(layer.gate_up_proj, "weight",
                                   torch.nn.Parameter(layer.gate_up_proj.weight * 0.5, requires_grad=False)),
                   lambda: setattr(layer.qkv_proj, "bias",
                                   torch.nn.Parameter(layer.qkv_proj.bias + 0.25, requires_grad=False))]
        for change in changes:
            before = _packed_step(model, 3)
            change()
            with_c, without = both()
            assert torch.equal(with_c, without) and not torch.equal(with_c, before)
    assert not torch.equal(first, with_c)


def test_the_whole_layer_call_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="contiguous 2-D"):
        cpu.weight_operand(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="int8 weight takes scales"):
        cpu.weight_operand(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="float32 \\[4\\]"):
        cpu.weight_operand(torch.zeros(4, 8), bias=torch.zeros(3))
    ordered = {False: (torch.zeros(2, 5, dtype=torch.long), torch.ones(2, dtype=torch.long))}
    args = (64, 4, 2, 16, 96, 1e-6, 0.25, torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        cpu.DecoderStep(17, *args, ordered)
    with pytest.raises(ValueError, match="must match the rows"):
        cpu.DecoderStep(3, *args, ordered)
    step = cpu.DecoderStep(2, *args, ordered)
    table = cpu.layer_table([cpu.SfLayer()])
    with pytest.raises(ValueError, match="contiguous \\[2, 64\\]"):
        step.layers(table, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="layers 0..2 of 1"):
        step.layers(table, torch.zeros(2, 64), 0, 2)
