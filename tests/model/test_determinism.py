"""Batch invariance on the real SmolLM2 (issue 23, SPEC.md Determinism): one prompt's prompt
logprobs (top 20) and its greedy tokens' logprobs (top 20) are bitwise the same scored alone cold,
alone warm, behind a partial-block hit, behind a prefix cached without its hidden states, in
bursts of 2 to 16 other prompts, with its prefill chunked at several budgets, and at 1 or 2
threads, within each ISA variant this machine runs; and a generated continuation, scored again
as a prompt, has the logprobs it was generated with.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

TEXT = ("Classify the sentiment of this review as positive or negative. Review: "
        + "the food was cold and the staff were rude but the view was great. " * 4
        + "Sentiment:")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=20, prompt_logprobs=20,
                        ignore_eos=True)


def scores(out):
    """Everything a scoring client reads, as plain values (compared with ==: bit for bit)."""
    prompt = [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in out.prompt_logprobs[1:]]
    gen = [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in out.logprobs]
    return prompt, gen


@pytest.fixture(scope="module")
def loaded(smollm2_fp32):
    return smollm2_fp32


def test_one_prompts_scores_whatever_runs_beside_it(loaded, isa):
    tok = loaded.tokenizer
    prompt = tok.encode(TEXT)
    others = [tok.encode(f"Other prompt {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1))
              for i in range(15)]

    def engine(**kw):
        budget = kw.pop("budget", 2048)
        return Engine(EngineConfig(max_model_len=512, kv_cache_memory=48 << 20, max_num_seqs=32,
                                   max_num_batched_tokens=budget, **kw), loaded).start()

    def run(eng, batch):
        rest = [SamplingParams(max_tokens=2 + i % 5, temperature=0.0, ignore_eos=True)
                for i in range(len(batch) - 1)]
        return scores(eng.generate([prompt, *batch[1:]], [PARAMS, *rest], timeout_s=300)[0])

    got = {}
    torch.set_num_threads(1)
    eng = engine()
    try:
        got["cold"] = run(eng, [prompt])
        got["warm"] = run(eng, [prompt])  # its full blocks from the prefix cache
    finally:
        eng.shutdown()
    for size in (2, 4, 8, 16):
        eng = engine()
        try:
            got[f"burst of {size}"] = run(eng, [prompt, *others[:size - 1]])
        finally:
            eng.shutdown()
    for budget in (16, 38, 76):  # 76: the last prefill chunk is one token
        eng = engine(budget=budget)
        try:
            got[f"chunks of {budget}"] = run(eng, [prompt])
        finally:
            eng.shutdown()
    eng = engine()
    try:  # its blocks cached by a request without prompt logprobs, whose step kept the
        # last layer's state at its last row only: the others' are computed again
        eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), timeout_s=300)
        assert int(eng.kv.hidden_valid.sum()) == 1
        got["behind a cached prefix without hidden states"] = run(eng, [prompt])
        assert int(eng.kv.hidden_valid.sum()) >= len(prompt)
    finally:
        eng.shutdown()
    for shared in (len(prompt), 70):  # a partial-block hit leaving 1 and 7 tokens to compute
        eng = engine(enable_partial_block_reuse=True)
        try:
            eng.generate([prompt[:shared] + [5, 6, 7]], PARAMS, timeout_s=300)
            got[f"partial hit of {shared}"] = run(eng, [prompt])
        finally:
            eng.shutdown()
    torch.set_num_threads(2)
    eng = engine()
    try:
        got["2 threads"] = run(eng, [prompt])
        got["2 threads, burst of 8"] = run(eng, [prompt, *others[:7]])
    finally:
        eng.shutdown()
        torch.set_num_threads(1)
    base = got["cold"]
    assert len(base[0]) == len(prompt) - 1 and len(base[1]) == 6
    differ = [name for name, value in got.items() if value != base]
    assert not differ, f"scores differ from the cold run: {differ}"


def test_a_continuation_scores_as_it_was_generated(loaded, isa):
    """Decode steps compute with the prompt's kernels too: scoring prompt + continuation as one
    prompt (echo) gives the logprobs the tokens had when they were generated."""
    prompt = loaded.tokenizer.encode(TEXT)
    eng = Engine(EngineConfig(max_model_len=512, kv_cache_memory=48 << 20), loaded).start()
    try:
        out = eng.generate([prompt], PARAMS, timeout_s=300)[0]
        text = prompt + out.new_token_ids
        echo = eng.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=20),
                            timeout_s=300)[0]
    finally:
        eng.shutdown()
    generated = [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)) for lp in out.logprobs]
    rescored = [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top))
                for lp in echo.prompt_logprobs[len(prompt):]]
    assert rescored == generated


def test_bf16_is_invariant_past_8_rows_with_linear_panels(smollm2_path):
    # --dtype bfloat16 hands steps of more than 8 rows to oneDNN (docs/api.md, Determinism:
    # "Limits"); --linear panels is the switch that keeps the bf16 panels' one summation order
    # for every row count: a 77-token prefill in one step, in chunks of 6 rows, or beside
    # other prompts gives the same bits.
    from freetoken import ops
    from freetoken.loader import load_model
    from freetoken.model.linear import packed_form

    if not ops.panel_linear_available(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("freetoken._C with bf16 panels not built")
    ops.configure(linear="panels")
    try:
        loaded = load_model(smollm2_path, dtype=torch.bfloat16, device="cpu", progress=False)
    finally:
        ops.configure()
    layer = loaded.model.layers[0].mlp.down_proj
    assert packed_form(layer.weight) == "panels" and layer.few_rows is None
    tok = loaded.tokenizer
    prompt = tok.encode(TEXT)
    assert len(prompt) > 8
    others = [tok.encode(f"Other prompt {i}: " + "lorem ipsum " * (i + 2)) for i in range(3)]
    got = {}
    for label, budget, batch in (("alone", 2048, []), ("chunks of 6", 6, []),
                                 ("beside 3 others", 2048, others)):
        eng = Engine(EngineConfig(max_model_len=512, kv_cache_memory=48 << 20, dtype="bfloat16",
                                  max_num_batched_tokens=budget, enable_prefix_cache=False),
                     loaded).start()
        try:
            rest = [SamplingParams(max_tokens=2, temperature=0.0)] * len(batch)
            got[label] = scores(eng.generate([prompt, *batch], [PARAMS, *rest],
                                             timeout_s=300)[0])
        finally:
            eng.shutdown()
    for label, value in got.items():
        assert value == got["alone"], label
