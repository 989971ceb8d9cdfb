"""ops.decoder_layer (csrc/decoder_layer/): one decoder layer in one C++ call must give
exactly what DecoderLayer.forward's Python path gives with the same kernels, on every kind of
step and weight form, and must refuse what it cannot serve."""

from __future__ import annotations

import pytest
import torch

from freetoken import ops
from freetoken.engine.generate import build_forward_batch
from freetoken.model.linear import FEW_ROWS
from freetoken.ops.backend import _C

pytestmark = pytest.mark.skipif(_C is None, reason="needs freetoken._C")


def run_steps(model, steps, block_size=4, num_blocks=24):
    """Logits of every step in order ([(seqs for build_forward_batch)]), one KV pool."""
    kv = model.make_kv_cache(num_blocks, block_size)
    out = []
    for seqs in steps:
        batch = build_forward_batch(seqs, block_size, all_logits=True)
        out.append(model.compute_logits(model.forward(batch, kv)))
    return out


def both_paths(model, steps, **kw):
    """(logits with the fused layers, logits with them off: the Python path)."""
    fused = [layer.fused for layer in model.layers]
    assert all(f is not None for f in fused)
    on = run_steps(model, steps, **kw)
    for layer in model.layers:
        layer.fused = None
    try:
        off = run_steps(model, steps, **kw)
    finally:
        for layer, f in zip(model.layers, fused):
            layer.fused = f
    return on, off


def prefill_then_decode(num_seqs: int, prompt_len: int = 11, decode_steps: int = 3):
    """A prefill of num_seqs prompts (one step), then decode steps of all of them, then a mixed
    step (one sequence's next chunk of 3 beside the others' single tokens)."""
    tables = [list(range(6 * s, 6 * s + 6)) for s in range(num_seqs)]
    prompts = [[(7 * s + 3 * i) % 97 + 3 for i in range(prompt_len + decode_steps + 3)]
               for s in range(num_seqs)]
    steps = [[(p[:prompt_len], 0, t) for p, t in zip(prompts, tables)]]
    for d in range(decode_steps):
        pos = prompt_len + d
        steps.append([([p[pos]], pos, t) for p, t in zip(prompts, tables)])
    pos = prompt_len + decode_steps
    steps.append([(p[pos:pos + (3 if s == 0 else 1)], pos, t)
                  for s, (p, t) in enumerate(zip(prompts, tables))])
    return steps


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("qwen2", {}),                      # q/k/v biases
    ("mistral", {"sliding_window": 5}),
])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_outputs_only_gives_the_logits_rows_bits(tiny_checkpoint, isa, arch, overrides,
                                                 num_seqs):
    """model.forward(outputs_only=True): the last layer takes only each sequence's last row
    past its K/V; those rows' hidden states and logits, and every K/V in the pool, are the bits
    of the whole forward's, and kv.hidden_valid tells the slots it kept from those it did not
    (a prefill, decode steps where every row is a logits row, a mixed step)."""
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint(arch, **overrides)
    model = load_model(path, load_tokenizer=False, progress=False).model
    steps = prefill_then_decode(num_seqs)
    kvs, outs = [], []
    for outputs_only in (False, True):
        kv = model.make_kv_cache(6 * num_seqs, 4)
        logits = []
        for seqs in steps:
            batch = build_forward_batch(seqs, 4)
            hidden = model.forward(batch, kv, outputs_only=outputs_only)
            logits.append(model.compute_logits(hidden))
            kept = batch.slot_mapping[batch.logits_indices]
            assert bool(kv.hidden_valid[kept].all())
            if outputs_only and batch.num_tokens > len(seqs):  # the prefill, the mixed step
                rest = torch.ones_like(kv.hidden_valid)
                rest[kept] = False
                assert not bool(kv.hidden_valid[batch.slot_mapping][rest[batch.slot_mapping]]
                                .any())
        kvs.append(kv)
        outs.append(logits)
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"step {i}"
    for a, b in zip([*kvs[0].k, *kvs[0].v], [*kvs[1].k, *kvs[1].v]):
        assert torch.equal(a, b)
    valid = kvs[1].hidden_valid
    assert torch.equal(kvs[0].hidden[valid], kvs[1].hidden[valid])


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("qwen2", {}),                      # q/k/v biases
    ("mistral", {"sliding_window": 5}),
    ("llama", {"num_key_value_heads": 4}),  # no GQA
    ("llama", {"num_key_value_heads": 1}),  # MQA
])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_fused_layers_equal_the_python_path(tiny_checkpoint, isa, arch, overrides, num_seqs):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint(arch, **overrides)
    model = load_model(path, load_tokenizer=False, progress=False).model
    on, off = both_paths(model, prefill_then_decode(num_seqs), num_blocks=6 * num_seqs)
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), f"step {i}"


def test_many_rows_and_few_rows_both_fused(tiny_checkpoint):
    """A prefill longer than FEW_ROWS takes the main panels, a decode step the same; both fused
    for an fp32 safetensors model (no few-rows form), serves() true for any row count."""
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, load_tokenizer=False, progress=False).model
    layer = model.layers[0]
    assert layer.fused.serves(1) and layer.fused.serves(FEW_ROWS + 1) and layer.fused.serves(500)
    on, off = both_paths(model, prefill_then_decode(2, prompt_len=FEW_ROWS + 9))
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_bf16_fuses_only_the_few_rows_steps(tiny_checkpoint):
    """bf16: the main form is oneDNN, so only steps of <= FEW_ROWS rows are fused (their bf16
    panels); longer steps take the Python path, and the results are the Python path's."""
    from freetoken.loader import load_model
    from freetoken.model.linear import packed_form

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, dtype=torch.bfloat16, load_tokenizer=False, progress=False).model
    if packed_form(model.layers[0].self_attn.qkv_proj.weight) != "onednn":
        pytest.skip("no oneDNN here: bf16 weights are panels for every row count")
    fused = model.layers[0].fused
    assert fused.serves(1) and fused.serves(FEW_ROWS) and not fused.serves(FEW_ROWS + 1)
    on, off = both_paths(model, prefill_then_decode(3, prompt_len=FEW_ROWS + 2))
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_qk_norm_models_keep_the_python_path(tiny_checkpoint):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path, load_tokenizer=False, progress=False).model
    assert all(layer.fused is None for layer in model.layers)


@pytest.mark.real_model
def test_smollm2_decode_steps_equal_the_python_path(smollm2_fp32):
    """The real model, GGUF blocks for the few-rows steps: 1 and 8 sequences, bit for bit."""
    model = smollm2_fp32.model
    for n in (1, FEW_ROWS):
        on, off = both_paths(model, prefill_then_decode(n, prompt_len=20, decode_steps=2),
                             block_size=16, num_blocks=6 * n)
        assert all(torch.equal(a, b) for a, b in zip(on, off)), n


def test_misshapen_weights_are_refused(tiny_checkpoint):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, load_tokenizer=False, progress=False).model
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    weights = [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
               mlp.down_proj.weight]
    kw = dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
              intermediate_size=mlp.intermediate_size, eps=1e-5, scale=attn.scale, window=None,
              few_rows_max=FEW_ROWS)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    ops.decoder_layer(*norms, weights, [None] * 4, [None] * 4, **kw)  # the right ones pass
    swapped = [weights[0], weights[2], weights[1], weights[3]]
    with pytest.raises(ValueError, match=r"weights\[1\] \(o\)"):
        ops.decoder_layer(*norms, swapped, [None] * 4, [None] * 4, **kw)
    with pytest.raises(ValueError, match=r"biases\[0\] \(qkv\)"):
        ops.decoder_layer(*norms, weights, [None] * 4, [torch.zeros(3), None, None, None], **kw)
    with pytest.raises(ValueError, match="lists of 4"):
        ops.decoder_layer(*norms, weights[:3], [None] * 4, [None] * 4, **kw)
    with pytest.raises(ValueError, match="num_heads"):
        ops.decoder_layer(*norms, weights, [None] * 4, [None] * 4, **{**kw, "num_kv_heads": 3})
    none = ops.decoder_layer(*norms, [None] * 4, [None] * 4, [None] * 4, **kw)
    assert not none.serves(1)


def test_a_model_with_one_layer_unfused_runs_its_layers_one_by_one(tiny_checkpoint):
    """ops.decoder_stack takes the step only where every layer is fused: with layer 1's fused
    call off the model calls each layer (the others fused, layer 1 in Python), with the same
    bits as all fused (the stack) and all in Python."""
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, load_tokenizer=False, progress=False).model
    with torch.inference_mode():
        assert ops.decoder_stack(*stack_args(model, 2)) is not None
    steps = prefill_then_decode(2)
    stacked, python = both_paths(model, steps)
    kept = model.layers[1].fused
    model.layers[1].fused = None
    try:
        mixed = run_steps(model, steps)
    finally:
        model.layers[1].fused = kept
    for i, (a, b, c) in enumerate(zip(stacked, mixed, python)):
        assert torch.equal(a, b) and torch.equal(b, c), f"step {i}"


def stack_args(model, rows: int):
    """decoder_stack's arguments for a step of `rows` new tokens of one sequence."""
    from freetoken.model.attention import build_attention_metadata

    kv = model.make_kv_cache(24, 4)
    batch = build_forward_batch([(list(range(3, 3 + rows)), 0, list(range(24)))], 4)
    x = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope(batch.positions, x.dtype, max(batch.seq_lens))
    meta = build_attention_metadata(batch, kv.block_size, model.config.sliding_window,
                                    dtype=x.dtype)
    kn = meta.kernel
    return ([layer.fused for layer in model.layers], x, cos, sin, kv.k, kv.v,
            kn.block_tables, kn.seq_lens, kn.query_start_loc, meta.slot_mapping)


def test_the_stack_declines_a_step_a_layer_does_not_serve(tiny_checkpoint):
    """bf16 layers serve steps of up to FEW_ROWS rows (their bf16 panels; oneDNN otherwise):
    a longer step returns None from decoder_stack, having written nothing into the KV pool."""
    from freetoken.loader import load_model
    from freetoken.model.linear import packed_form

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, dtype=torch.bfloat16, load_tokenizer=False, progress=False).model
    if packed_form(model.layers[0].self_attn.qkv_proj.weight) != "onednn":
        pytest.skip("no oneDNN here: bf16 weights are panels for every row count")
    with torch.inference_mode():
        args = stack_args(model, FEW_ROWS + 1)
        assert ops.decoder_stack(*args) is None
        assert all(int(torch.count_nonzero(k)) == 0 for k in args[4])
        out, residual = ops.decoder_stack(*stack_args(model, FEW_ROWS))
        assert out.shape == residual.shape == (FEW_ROWS, model.config.hidden_size)


def test_the_stack_refuses_a_cache_list_of_the_wrong_length(tiny_checkpoint):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")
    model = load_model(path, load_tokenizer=False, progress=False).model
    with torch.inference_mode():
        args = list(stack_args(model, 2))
        args[4] = args[4][:-1]
        with pytest.raises(ValueError, match=r"k_caches"):
            ops.decoder_stack(*args)
        with pytest.raises(ValueError, match=r"layers"):
            ops.decoder_stack([], *args[1:])
