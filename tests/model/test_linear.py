"""The packed linears: panels (fp32; bf16 for few rows, freetoken._C) and oneDNN (bf16, or
ops.configure(linear="onednn")) give F.linear's numbers, linear="torch" is the way out, and a
model runs the same in every form. The panel kernel itself: tests/test_panel_linear.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from freetoken import ops
from freetoken.engine.generate import build_forward_batch
from freetoken.model.linear import (
    FEW_ROWS,
    Linear,
    _onednn_bf16_supported,
    linear,
    pack_few_rows,
    pack_weight,
    packed_form,
    packing_available,
    panels_available,
)

torch.set_num_threads(1)

needs_packing = pytest.mark.skipif(
    not packing_available(torch.empty(1)), reason="no packed linear available"
)
needs_panels = pytest.mark.skipif(
    not ops.panel_linear_available(torch.empty(1)), reason="freetoken._C panels not available"
)
needs_onednn_bf16 = pytest.mark.skipif(
    not packing_available(torch.empty(1)) or not _onednn_bf16_supported(),
    reason="oneDNN's packed bf16 linear needs AVX512-BW/VL/DQ or AVX-NE-CONVERT")
FORMS = ["auto", "onednn"]


@needs_packing
@pytest.mark.parametrize("mode", FORMS)
@pytest.mark.parametrize("rows", [1, 3, 8, 224])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_fp32(mode, rows, bias, ops_config):
    ops_config(linear=mode)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    packed = pack_weight(w)
    want = "panels" if mode == "auto" and panels_available(w) else "onednn"
    assert packed_form(packed) == want
    got = linear(x, packed, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    if want == "onednn":
        torch.testing.assert_close(packed.to_dense(), w, atol=0, rtol=0)
    # a leading batch dimension and a non-contiguous input work too
    x3 = torch.randn(2, rows, 192, generator=g)[..., ::2]
    torch.testing.assert_close(linear(x3, packed, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("mode", FORMS)
@pytest.mark.parametrize("rows", [1, 5, FEW_ROWS, FEW_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_bf16(mode, rows, bias, ops_config):
    """bf16: oneDNN serves every row count; with the panels too, they take <= FEW_ROWS rows."""
    ops_config(linear=mode)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 32, generator=g).bfloat16()
    b = torch.randn(64, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 32, generator=g).bfloat16()
    packed, few = pack_weight(w), pack_few_rows(w)
    assert packed_form(packed) == "onednn"
    assert (few is not None) == (mode == "auto" and panels_available(w))
    got = linear(x, packed, b, few)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=0.1, rtol=0.02)
    if few is not None and rows <= FEW_ROWS:  # it is the panels' result, bitwise
        assert torch.equal(got, ops.panel_linear(x, few, b))


@needs_panels
@pytest.mark.parametrize("rows", [1, FEW_ROWS + 1, 40])
def test_bf16_without_onednn_bf16_takes_the_panels(rows, ops_config, monkeypatch):
    """On a CPU where oneDNN refuses bf16 (AVX2 only: its reorder raises), a bf16 weight is
    packed as panels for every row count, with no second form, and gives F.linear's numbers;
    with linear="onednn" (no panels) it stays a plain weight for F.linear."""
    import freetoken.model.linear as lin

    monkeypatch.setattr(lin, "_onednn_bf16_supported", lambda: False)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 32, generator=g).bfloat16()
    x = torch.randn(rows, 32, generator=g).bfloat16()
    packed, few = pack_weight(w), pack_few_rows(w)
    assert packed_form(packed) == "panels" and few is None
    got = linear(x, packed, None, few)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=0.1, rtol=0.02)
    ops_config(linear="onednn")
    assert not packing_available(w)


@needs_packing
def test_module_pack_and_the_torch_switch(ops_config):
    layer = Linear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(4, 16)
    with torch.no_grad():
        plain = layer(x)
        ops_config(linear="torch")
        assert layer.pack() is False and packed_form(layer.weight) == "plain"
        ops_config()
        assert layer.pack() is True and packed_form(layer.weight) != "plain"
        assert layer.pack() is True  # packing twice is a no-op
        torch.testing.assert_close(layer(x), plain, atol=1e-5, rtol=1e-5)


def test_a_bad_mode_is_refused(ops_config):
    with pytest.raises(ValueError, match="linear must be one of .*, got 'fast'"):
        ops_config(linear="fast")
    assert ops.config().linear == "auto"


@needs_packing
def test_model_logits_same_in_every_form(tiny_checkpoint, ops_config):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("qwen2")  # q/k/v biases, an untied lm_head
    models = {}
    for mode in ("auto", "onednn", "torch"):
        ops_config(linear=mode)
        models[mode] = load_model(path, load_tokenizer=False, progress=False)
    forms = {m: packed_form(x.model.layers[0].self_attn.qkv_proj.weight)
             for m, x in models.items()}
    assert forms["onednn"] == "onednn" and forms["torch"] == "plain"
    assert forms["auto"] == ("panels" if ops.panel_linear_available(torch.empty(1)) else "onednn")
    assert packed_form(models["auto"].model.lm_head.weight) == forms["auto"]
    seqs = [(list(range(3, 20)), 0, [0, 1, 2, 3, 4]), ([5, 6], 0, [7])]
    out = []
    for loaded in models.values():
        assert loaded.model.logits_width == loaded.config.vocab_size
        kv = loaded.model.make_kv_cache(8, 4)
        batch = build_forward_batch(seqs, 4, all_logits=True)
        out.append(loaded.model.compute_logits(loaded.model.forward(batch, kv)))
    for o in out[1:]:
        torch.testing.assert_close(o, out[0], atol=1e-4, rtol=0)


@needs_panels
def test_tied_lm_head_gets_a_panel_copy(smollm2_path, ops_config):
    from freetoken.loader import load_model

    ops_config(linear="panels")  # every weight dequantized to fp32
    m = load_model(smollm2_path, load_tokenizer=False, progress=False).model
    assert packed_form(m.layers[0].mlp.down_proj.weight) == "panels"
    assert m.lm_head is None and packed_form(m.lm_head_packed) == "panels"
    assert m.logits_width == 49152
    h = torch.randn(3, m.config.hidden_size)
    torch.testing.assert_close(m.compute_logits(h), F.linear(h, m.embed_tokens.weight),
                               atol=1e-4, rtol=1e-5)


@needs_panels
def test_smollm2_weights_stay_in_the_files_blocks(smollm2_path, smollm2_fp32, ops_config):
    """linear "gguf" (what "auto" does for models over 1 GiB as fp32 of other types than Q4_1 /
    Q8_0): every projection, the tied lm_head and the embedding read the file's memory map in
    place; the logits are those of the dequantized weights (and of the default's block panels),
    and the embedding's rows are exactly theirs."""
    from freetoken.loader import load_model
    from freetoken.model.llama import GGUFEmbedding

    ops_config(linear="gguf")
    m = load_model(smollm2_path, load_tokenizer=False, progress=False).model
    assert packed_form(m.layers[0].mlp.down_proj.weight) == "gguf"
    assert m.lm_head is None and packed_form(m.lm_head_packed) == "gguf"
    assert isinstance(m.embed_tokens, GGUFEmbedding) and m.logits_width == 49152
    matrix = m.embed_tokens.matrix
    weight = ops.dequantize_gguf(matrix.mapping[matrix.offsets[:, None] + torch.arange(
        ops.gguf_row_bytes(matrix.types[0], matrix.in_features))], matrix.types[0], 576)
    ids = torch.tensor([0, 5, 49151, 5])
    assert torch.equal(m.embed_tokens(ids), weight[ids])
    gguf = pytest.importorskip("gguf")
    assert torch.equal(weight, torch.from_numpy(gguf.quants.dequantize(
        np.asarray(matrix.row_table()), gguf.GGMLQuantizationType.Q8_0)))
    h = torch.randn(3, m.config.hidden_size)
    torch.testing.assert_close(m.compute_logits(h), F.linear(h, weight), atol=1e-4, rtol=1e-5)
    seqs = [(list(range(3, 40)), 0, [0, 1, 2]), ([5, 6, 7], 0, [3])]
    out = []
    for model in (m, smollm2_fp32.model):
        kv = model.make_kv_cache(8, 16)
        out.append(model.compute_logits(model.forward(build_forward_batch(seqs, 16), kv)))
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=0)


@needs_panels
@needs_onednn_bf16
def test_bf16_model_uses_the_panels_for_few_rows(tiny_checkpoint, ops_config):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")  # tied embeddings: the lm_head's copy too
    models = {}
    for mode in ("auto", "onednn"):
        ops_config(linear=mode)
        models[mode] = load_model(path, dtype=torch.bfloat16, load_tokenizer=False,
                                  progress=False)
    auto, onednn = models["auto"].model, models["onednn"].model
    assert packed_form(auto.layers[0].mlp.gate_up_proj.weight) == "onednn"
    assert packed_form(auto.layers[0].mlp.gate_up_proj.few_rows) == "panels"
    assert onednn.layers[0].mlp.gate_up_proj.few_rows is None
    if auto.lm_head is None:
        assert packed_form(auto.lm_head_few_rows) == "panels"
    seqs = [([3, 4, 5], 0, [0]), ([6, 7], 0, [1])]  # 5 tokens: the few-rows path
    out = []
    for m in (auto, onednn):
        kv = m.make_kv_cache(4, 4)
        out.append(m.compute_logits(m.forward(build_forward_batch(seqs, 4), kv)))
    torch.testing.assert_close(out[0], out[1], atol=0.05, rtol=0.02)


def test_which_ggufs_keep_only_block_panels(ops_config):
    """Under "auto" a GGUF whose matrices are all Q4_1 / Q8_0 / Q4_K / Q6_K and that is at most
    IN_PLACE_MIN_BYTES as fp32 (SmolLM2) keeps them only as block panels; a larger one its
    Q4_1 / Q4_K / Q6_K matrices (its Q8_0 and the rest in place); a small one with other
    types, and every other linear mode or the int8 mode, none."""
    from freetoken.model.linear import IN_PLACE_MIN_BYTES, block_panels_wanted, gguf_in_place

    small, large = 500 << 20, IN_PLACE_MIN_BYTES + 1
    assert block_panels_wanted(small, {"Q4_1", "Q8_0"}) == {"Q4_1", "Q8_0"}
    assert block_panels_wanted(small, {"Q8_0"}) == {"Q8_0"}
    assert block_panels_wanted(small, {"Q4_K", "Q8_0"}) == {"Q4_K", "Q8_0"}
    assert not block_panels_wanted(large, {"Q8_0"})
    assert block_panels_wanted(large, {"Q4_K", "Q6_K", "Q8_0"}) == {"Q4_K", "Q6_K"}
    assert block_panels_wanted(large, {"Q5_K", "Q6_K"}) == {"Q6_K"}
    assert block_panels_wanted(small, {"Q4_K", "Q6_K"}) == {"Q4_K", "Q6_K"}
    assert not block_panels_wanted(small, {"Q4_1", "Q5_K"})
    assert not block_panels_wanted(small, set())
    if ops.panel_linear_available(torch.empty(1)):
        assert gguf_in_place(torch.float32, "cpu", small, {"Q4_1"})
        assert gguf_in_place(torch.float32, "cpu", small, {"Q6_K"})
        assert not gguf_in_place(torch.float32, "cpu", small, {"Q5_K"})
        assert not gguf_in_place(torch.bfloat16, "cpu", small, {"Q4_1"})
    for mode in ("gguf", "panels", "onednn", "torch"):
        ops_config(linear=mode)
        assert not block_panels_wanted(small, {"Q4_1"}), mode
    ops_config(linear="auto", compute="int8")
    assert not block_panels_wanted(small, {"Q4_1"})
