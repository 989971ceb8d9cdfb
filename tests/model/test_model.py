"""The forward: parity with transformers on the real SmolLM2 GGUF, and the paged-KV invariants
(batched = one at a time, chunked = one-shot, decode batch = single decode, prefix reuse)."""

from __future__ import annotations

import inspect

import pytest
import torch

from freetoken.engine.generate import build_forward_batch, generate

torch.set_num_threads(1)

BLOCK_SIZE = 16


def make_prompts() -> list[list[int]]:
    """12 token-id prompts of 5..300 tokens (no tokenizer involved): random ids from the common
    part of the vocabulary, a repeated phrase (peaked predictions), chat-marker-shaped ones."""
    g = torch.Generator().manual_seed(1234)
    lengths = [5, 9, 17, 31, 48, 64, 100, 129, 170, 222, 256, 300]
    prompts = []
    for i, n in enumerate(lengths):
        if i % 3 == 1:
            phrase = torch.randint(200, 8000, (7,), generator=g).tolist()
            ids = (phrase * (n // 7 + 1))[:n]
        elif i % 3 == 2:
            ids = (
                [1, 9690, 198]
                + torch.randint(100, 30000, (n - 5,), generator=g).tolist()
                + [2, 198]
            )
        else:
            ids = torch.randint(0, 49152, (n,), generator=g).tolist()
        prompts.append(ids)
    return prompts


PROMPTS = make_prompts()


def blocks_for(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK_SIZE)))


def last_logits(loaded, seqs, kv) -> torch.Tensor:
    batch = build_forward_batch(seqs, BLOCK_SIZE)
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    # transformers 5 renamed past_key_values -> cache
    cache_kw = (
        "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    )
    ids = torch.tensor([prompt])
    out_ids, past = [], None
    with torch.no_grad():
        for _ in range(num_new):
            out = hf_model(ids, use_cache=True, **{cache_kw: past})
            past = getattr(out, cache_kw)
            token = int(out.logits[0, -1].argmax())
            out_ids.append(token)
            ids = torch.tensor([[token]])
    return out_ids


@pytest.mark.real_model
def test_smollm2_last_logits_match_transformers(smollm2_fp32, transformers_smollm2):
    assert len(PROMPTS) >= 12 and min(map(len, PROMPTS)) == 5 and max(map(len, PROMPTS)) == 300
    kv = smollm2_fp32.model.make_kv_cache(-(-300 // BLOCK_SIZE), BLOCK_SIZE)
    worst = 0.0
    for ids in PROMPTS:
        ours = last_logits(smollm2_fp32, [(ids, 0, blocks_for(len(ids)))], kv)[0]
        with torch.no_grad():
            ref = transformers_smollm2(torch.tensor([ids])).logits[0, -1].float()
        diff = float((ours - ref).abs().max())
        worst = max(worst, diff)
        assert diff < 1e-3, (len(ids), diff)
        assert int(ours.argmax()) == int(ref.argmax())
    print(f"max |logit diff| over {len(PROMPTS)} prompts: {worst:.2e}")


@pytest.mark.real_model
@pytest.mark.parametrize("prompt_index", [0, 4, 8, 11])
def test_smollm2_greedy_matches_transformers(smollm2_fp32, transformers_smollm2, prompt_index):
    prompt = PROMPTS[prompt_index]
    ids, logprobs = generate(smollm2_fp32, prompt, 32)
    assert ids == hf_greedy(transformers_smollm2, prompt, 32)
    assert len(logprobs) == 32 and all(lp <= 0.0 for lp in logprobs)


@pytest.mark.real_model
def test_batched_prefill_equals_one_at_a_time(smollm2_fp32):
    prompts = [PROMPTS[1], PROMPTS[5], PROMPTS[3], PROMPTS[0]]  # 9, 64, 31, 5 tokens
    kv = smollm2_fp32.model.make_kv_cache(16, BLOCK_SIZE)
    singles = [last_logits(smollm2_fp32, [(p, 0, blocks_for(len(p)))], kv)[0] for p in prompts]
    seqs, first = [], 0
    for p in prompts:  # distinct, non-contiguous blocks per sequence
        seqs.append((p, 0, blocks_for(len(p), first)[::-1]))
        first += len(seqs[-1][2]) + 1
    batched = last_logits(smollm2_fp32, seqs, kv)
    for single, row in zip(singles, batched, strict=True):
        torch.testing.assert_close(row, single, atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_chunked_prefill_equals_one_shot_and_fills_kv(smollm2_fp32):
    prompt = PROMPTS[7]  # 129 tokens
    blocks = blocks_for(len(prompt))
    kv_one = smollm2_fp32.model.make_kv_cache(len(blocks), BLOCK_SIZE)
    one_shot = last_logits(smollm2_fp32, [(prompt, 0, blocks)], kv_one)[0]
    kv = smollm2_fp32.model.make_kv_cache(len(blocks), BLOCK_SIZE)
    split = 50  # not a block boundary
    last_logits(smollm2_fp32, [(prompt[:split], 0, blocks)], kv)
    chunked = last_logits(smollm2_fp32, [(prompt[split:], split, blocks)], kv)[0]
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=0)
    n = len(prompt)
    for layer in (0, 29):
        torch.testing.assert_close(
            kv.k[layer].view(-1, 3, 64)[:n], kv_one.k[layer].view(-1, 3, 64)[:n], atol=1e-4, rtol=0
        )
    # kv.hidden holds every token's final-norm hidden state: logits of any cached position
    logits_mid = smollm2_fp32.model.compute_logits(kv.hidden[split - 1 : split])
    ref_mid = last_logits(smollm2_fp32, [(prompt[:split], 0, blocks)], kv_one)
    torch.testing.assert_close(logits_mid, ref_mid, atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_batched_decode_equals_single_decode(smollm2_fp32):
    model = smollm2_fp32.model
    prompts = [PROMPTS[2], PROMPTS[6], PROMPTS[0]]  # 17, 100, 5 tokens
    kv = model.make_kv_cache(32, BLOCK_SIZE)
    tables = [blocks_for(len(p) + 4, first) for p, first in zip(prompts, (0, 10, 20))]
    batch = [(p, 0, t) for p, t in zip(prompts, tables)]
    first_tokens = last_logits(smollm2_fp32, batch, kv).argmax(-1).tolist()
    # one decode step for all three at once...
    decode = [([tok], len(p), t) for tok, p, t in zip(first_tokens, prompts, tables)]
    batched = last_logits(smollm2_fp32, decode, kv)
    # ...equals each decoded alone (a fresh cache each: prefill, then the one decode step)
    for i, (p, t) in enumerate(zip(prompts, tables)):
        kv1 = model.make_kv_cache(32, BLOCK_SIZE)
        last_logits(smollm2_fp32, [(p, 0, t)], kv1)
        single = last_logits(smollm2_fp32, [([first_tokens[i]], len(p), t)], kv1)[0]
        torch.testing.assert_close(batched[i], single, atol=1e-4, rtol=0)
        assert int(batched[i].argmax()) == int(single.argmax())


@pytest.mark.real_model
def test_mixed_step_and_prefix_reuse(smollm2_fp32):
    """One step with a decode, a chunk continuing a prompt, and a sequence whose first two blocks
    were computed by another sequence (prefix cache): each equals its cold one-shot logits."""
    model = smollm2_fp32.model
    a, b = PROMPTS[5], PROMPTS[9]  # 64 and 222 tokens
    shared = a[:32]  # two full blocks
    c = shared + PROMPTS[3][:20]  # 52 tokens, shares blocks 0,1 of `a`
    kv = model.make_kv_cache(64, BLOCK_SIZE)
    ta, tb = blocks_for(len(a) + 1, 0), blocks_for(len(b), 10)
    tc = ta[:2] + blocks_for(len(c) - 32, 40)
    prev = last_logits(smollm2_fp32, [(a, 0, ta), (b[:100], 0, tb)], kv)
    next_a = int(prev[0].argmax())
    step = [([next_a], len(a), ta), (b[100:], 100, tb), (c[32:], 32, tc)]
    got = last_logits(smollm2_fp32, step, kv)
    for row, ids, table in zip(got, (a + [next_a], b, c), (ta, tb, tc)):
        kv_cold = model.make_kv_cache(len(table), BLOCK_SIZE)
        cold = last_logits(smollm2_fp32, [(ids, 0, list(range(len(table))))], kv_cold)[0]
        torch.testing.assert_close(row, cold, atol=1e-4, rtol=0)


def test_tiny_llama_forward_contract(tiny_checkpoint):
    """hidden comes back only at logits_indices; kv.hidden is written at every slot."""
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("llama")
    loaded = load_model(path, load_tokenizer=False, progress=False)
    kv = loaded.model.make_kv_cache(4, 4)
    ids = list(range(5, 15))
    batch = build_forward_batch([(ids, 0, [3, 0, 2])], 4, all_logits=True)
    hidden = loaded.model.forward(batch, kv)
    assert hidden.shape == (10, loaded.config.hidden_size)
    torch.testing.assert_close(kv.hidden[batch.slot_mapping], hidden)
    assert kv.hidden[4:8].abs().sum() == 0  # block 1 unused
    logits = loaded.model.compute_logits(hidden)
    assert logits.shape == (10, loaded.config.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_computing_them(tiny_checkpoint, dtype):
    """rope() reads cos/sin rows from a table that grows with the positions asked for (llama3
    scaling here): bit for bit what computing them for the step's positions gives."""
    from freetoken.loader import load_model

    model = load_model(tiny_checkpoint("llama")[0], load_tokenizer=False, progress=False).model
    g = torch.Generator().manual_seed(0)
    for num_positions, T in [(10, 3), (300, 17), (5000, 64), (40, 1)]:
        positions = torch.randint(0, num_positions, (T,), generator=g)
        positions[0] = num_positions - 1
        freqs = positions.float()[:, None] * model.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = model.rope(positions, dtype, num_positions)
        assert cos.shape == sin.shape == (T, 1, emb.shape[1]) and cos.dtype == dtype
        assert torch.equal(cos, emb.cos().to(dtype)[:, None, :])
        assert torch.equal(sin, emb.sin().to(dtype)[:, None, :])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_cpu(tiny_checkpoint):
    from freetoken.loader import load_model

    path, _ = tiny_checkpoint("qwen3")
    cpu = load_model(path, load_tokenizer=False, progress=False)
    gpu = load_model(
        path, dtype=torch.bfloat16, device="cuda", load_tokenizer=False, progress=False
    )
    prompts = [list(range(3, 30)), [7, 8, 9]]
    seqs = [(prompts[0], 0, [0, 1, 2, 3, 4, 5, 6]), (prompts[1], 0, [9])]
    out = []
    for loaded, device in ((cpu, "cpu"), (gpu, "cuda")):
        kv = loaded.model.make_kv_cache(10, 4)
        batch = build_forward_batch(seqs, 4, device=device)
        out.append(loaded.model.compute_logits(loaded.model.forward(batch, kv)).cpu())
    assert (out[0].argmax(-1) == out[1].argmax(-1)).all()
    torch.testing.assert_close(out[1], out[0], atol=0.1, rtol=0.05)


@pytest.mark.parametrize("arch, overrides", [("mistral", {"sliding_window": 8}), ("qwen3", {})])
def test_tiny_chunked_and_decode_match_transformers(tiny_checkpoint, arch, overrides):
    """Teacher-forced: a 13-token chunk, a 9-token chunk, then 6 single-token decode steps
    (two sequences batched) give transformers' logits at every step, sliding window included."""
    from freetoken.loader import load_model

    path, hf_model = tiny_checkpoint(arch, **overrides)
    loaded = load_model(path, load_tokenizer=False, progress=False)
    seqs = [list(range(3, 31)), list(range(40, 68))[::-1]]  # 28 tokens each
    with torch.no_grad():
        refs = [hf_model(torch.tensor([s])).logits[0].float() for s in seqs]
    kv = loaded.model.make_kv_cache(16, 4)
    tables = [[1, 3, 5, 7, 9, 11, 13], [0, 2, 4, 6, 8, 10, 12]]
    steps = [(0, 13), (13, 22)] + [(p, p + 1) for p in range(22, 28)]
    for start, end in steps:
        batch = build_forward_batch(
            [(s[start:end], start, t) for s, t in zip(seqs, tables)], 4, all_logits=True
        )
        logits = loaded.model.compute_logits(loaded.model.forward(batch, kv))
        n = end - start
        for i, ref in enumerate(refs):
            torch.testing.assert_close(
                logits[i * n : (i + 1) * n], ref[start:end], atol=1e-4, rtol=0
            )
