"""The oneDNN packed linear: same numbers as F.linear, the FREETOKEN_LINEAR=torch way out, and a
model that runs the same either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.generate import build_forward_batch
from freetoken.model.linear import Linear, linear, pack_weight, packing_available

torch.set_num_threads(1)

needs_onednn = pytest.mark.skipif(
    not packing_available(torch.empty(1)), reason="oneDNN packed linear not available"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 224])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_fp32(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    got = linear(x, packed, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed.to_dense(), w, atol=0, rtol=0)
    # a leading batch dimension and a non-contiguous input work too
    x3 = torch.randn(2, rows, 192, generator=g)[..., ::2]
    torch.testing.assert_close(linear(x3, packed, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packed_linear_bf16():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g).bfloat16()
    x = torch.randn(5, 32, generator=g).bfloat16()
    got = linear(x, pack_weight(w), None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=0.1, rtol=0.02)


@needs_onednn
def test_module_pack_and_the_torch_switch(monkeypatch):
    layer = Linear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 16)
    with torch.no_grad():
        plain = layer(x)
        monkeypatch.setenv("FREETOKEN_LINEAR", "torch")
        assert layer.pack() is False and not layer.weight.is_mkldnn
        monkeypatch.delenv("FREETOKEN_LINEAR")
        assert layer.pack() is True and layer.weight.is_mkldnn
        assert layer.pack() is True  # packing twice is a no-op
        torch.testing.assert_close(layer(x), plain, atol=1e-5, rtol=1e-5)
    assert sum(p.numel() for p in layer.parameters()) == 16 * 8 + 8


@needs_onednn
def test_model_logits_same_packed_or_not(tiny_checkpoint, monkeypatch):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("qwen2")  # q/k/v biases
    packed = load_model(path, load_tokenizer=False, progress=False)
    monkeypatch.setenv("FREETOKEN_LINEAR", "torch")
    plain = load_model(path, load_tokenizer=False, progress=False)
    assert packed.model.layers[0].self_attn.qkv_proj.weight.is_mkldnn
    assert not plain.model.layers[0].self_attn.qkv_proj.weight.is_mkldnn
    seqs = [(list(range(3, 20)), 0, [0, 1, 2, 3, 4]), ([5, 6], 0, [7])]
    out = []
    for loaded in (packed, plain):
        kv = loaded.model.make_kv_cache(8, 4)
        batch = build_forward_batch(seqs, 4, all_logits=True)
        out.append(loaded.model.compute_logits(loaded.model.forward(batch, kv)))
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=0)
