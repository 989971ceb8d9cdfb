"""The engine on the real SmolLM2 (fp32, CPU): prefix hit == cold, 64 concurrent mixed requests
== one at a time (with preemption, chunked prefill and aborts), batched decode == alone, seeded
sampling, allowed_token_ids, prompt logprobs against a direct forward.

One file: its tests share one loaded SmolLM2 and the engine fixtures.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine import Engine
from freetoken.engine.generate import build_forward_batch
from freetoken.engine.sampler import Sampler
from freetoken.engine.sampling_params import SamplingParams
from freetoken.errors import ContextTooLong, InvalidRequest
from freetoken.testing.workloads import PREFIX

pytestmark = pytest.mark.real_model

# The benchmarks' few-shot prefix (~175 tokens) plus two more examples: >= 200 tokens.
PREFIX_TEXT = PREFIX + (
    "Review: The manual is useless and customer support hung up on me twice this morning.\n"
    "Sentiment: Negative\n\n"
    "Review: Sturdy, comfortable chair; assembly took ten minutes and my back thanks me.\n"
    "Sentiment: Positive\n\n"
)


def greedy(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


@pytest.fixture(scope="module")
def loaded(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded.tokenizer


@pytest.fixture
def make_engine(loaded):
    engines = []

    def make(**kw):
        kw.setdefault("num_kv_blocks", 256)
        eng = Engine(EngineConfig(**kw), loaded).start()
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def prefix_ids(tok):
    ids = tok.encode(PREFIX_TEXT)
    assert len(ids) >= 200
    return ids[:200]


def assert_lp_close(a, b, tol=1e-4):
    assert a.token_id == b.token_id
    assert abs(a.logprob - b.logprob) <= tol
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for (_, x), (_, y) in zip(a.top, b.top):
        assert abs(x - y) <= tol


@pytest.mark.parametrize("partial", [True, False], ids=["partial-block", "full-blocks"])
def test_prefix_hit_equals_cold(make_engine, tok, prefix_ids, partial):
    a = prefix_ids + tok.encode(" Review: It works.\nSentiment:", add_special_tokens=False)
    b = prefix_ids + tok.encode(" Review: Terrible fit, sent it back.\nSentiment:",
                                add_special_tokens=False)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the 200 + " Review:"
    assert 200 < shared < 208 < len(a)  # a's block 12 is full, so it is indexed
    params = greedy(max_tokens=6, logprobs=20, prompt_logprobs=5)
    cold = make_engine(enable_prefix_cache=False).generate([b], params)[0]
    warm_engine = make_engine(enable_partial_block_reuse=partial)
    first = warm_engine.generate([a], params)[0]
    assert first.num_cached_tokens == 0
    warm = warm_engine.generate([b], params)[0]
    # full blocks only: the shared full-block length; with the partial block: every shared token
    expected = shared if partial else (shared // 16) * 16
    assert warm.num_cached_tokens == expected
    assert cold.num_cached_tokens == 0
    assert warm.new_token_ids == cold.new_token_ids
    assert warm.new_text == cold.new_text
    for x, y in zip(warm.logprobs, cold.logprobs, strict=True):
        assert_lp_close(x, y)
    # prompt logprobs: the cached positions come from the cached hidden states, no recompute
    assert warm.prompt_logprobs[0] is None and cold.prompt_logprobs[0] is None
    assert len(warm.prompt_logprobs) == len(b)
    for x, y in zip(warm.prompt_logprobs[1:], cold.prompt_logprobs[1:], strict=True):
        assert_lp_close(x, y)
        assert x.rank == y.rank
    st = warm_engine.stats()
    assert st["prefix_hits"] == expected and st["prefix_queries"] == len(a) + len(b)


def test_prompt_logprobs_match_a_direct_forward(make_engine, loaded, tok, prefix_ids):
    prompt = prefix_ids[:40] + tok.encode(" and that is all.", add_special_tokens=False)
    model = loaded.model
    kv = model.make_kv_cache(8, 16)
    batch = build_forward_batch([(prompt, 0, list(range(8)))], 16, all_logits=True)
    logp = torch.log_softmax(model.compute_logits(model.forward(batch, kv)), -1)  # [L, V]
    eng = make_engine()
    eng.generate([prefix_ids[:40] + [5, 6, 7]], greedy(max_tokens=1))  # warm 2 blocks
    out = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 32 and out.new_token_ids == []
    assert out.finish_reason == "length"
    for p in range(1, len(prompt)):
        lp = out.prompt_logprobs[p]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - float(logp[p - 1, prompt[p]])) < 1e-4
        assert lp.rank == 1 + int((logp[p - 1] > logp[p - 1, prompt[p]]).sum())
        assert lp.top[0][0] == int(logp[p - 1].argmax())


def test_batched_decode_of_8_streams_equals_each_alone(make_engine, tok):
    texts = ["The sky is", "My favourite food is", "def fibonacci(n):", "Once upon a time",
             "The best way to learn", "In 1492,", "Water boils at", "Dear Sir or Madam,"]
    prompts = [tok.encode(t) for t in texts]
    params = greedy(max_tokens=16)
    eng = make_engine(enable_prefix_cache=False)
    together = eng.generate(prompts, params)
    for p, out in zip(prompts, together):
        alone = eng.generate([p], params)[0]
        assert out.new_token_ids == alone.new_token_ids
        assert len(out.new_token_ids) == 16 and out.finish_reason == "length"


def test_64_concurrent_mixed_requests_match_one_at_a_time(make_engine, tok, prefix_ids):
    rng = random.Random(7)
    reviews = ["good", "bad", "it broke", "love it", "meh, fine", "would buy again",
               "never again", "five stars"]
    jobs = []  # (prompt ids, params, abort_after or None)
    for i in range(64):
        kind = i % 4
        if kind == 0:    # scoring: shared prefix, max_tokens 1, logprobs 2
            p = prefix_ids + tok.encode(f" Review: {reviews[i % 8]} #{i}\nSentiment:",
                                        add_special_tokens=False)
            jobs.append((p, greedy(max_tokens=1, logprobs=2), None))
        elif kind == 1:  # generation of different lengths
            p = tok.encode(f"Story {i}: " + " ".join(rng.choice(reviews) for _ in range(i % 9)))
            jobs.append((p, greedy(max_tokens=rng.randint(1, 10)), None))
        elif kind == 2:  # echo scoring of a long prompt, partly cached
            p = prefix_ids[:rng.randint(20, 200)] + [rng.randrange(100, 40000)]
            jobs.append((p, SamplingParams(max_tokens=0, prompt_logprobs=1), None))
        else:            # long generations, some aborted midway
            p = tok.encode(f"List {i} numbers:")
            jobs.append((p, greedy(max_tokens=16), 3 if i % 8 == 3 else None))

    # 48 blocks = 768 token slots for ~5.8k tokens of work: admission is held; chunked prefill
    eng = make_engine(num_kv_blocks=48, max_num_batched_tokens=128, max_num_seqs=16)

    async def run_all():
        async def one(i, prompt, params, abort_after):
            stream = eng.submit(prompt, params, request_id=f"r{i}")
            deltas = []
            async for out in stream:
                deltas.append(out)
                if abort_after is not None and sum(len(d.new_token_ids) for d in deltas) >= \
                        abort_after and not out.finished:
                    eng.abort(f"r{i}")
            return deltas
        return await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))

    results = asyncio.run(run_all())
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks

    ref_engine = make_engine(num_kv_blocks=64)
    for (prompt, params, abort_after), deltas in zip(jobs, results):
        ids = [t for d in deltas for t in d.new_token_ids]
        last = deltas[-1]
        assert last.finished
        if abort_after is not None:
            assert last.finish_reason == "abort" and len(ids) >= abort_after
            ref = ref_engine.generate([prompt], greedy(max_tokens=len(ids)))[0]
            assert ids == ref.new_token_ids  # what it produced before the abort is right
            continue
        ref = ref_engine.generate([prompt], params)[0]
        assert ids == ref.new_token_ids
        assert last.finish_reason == ref.finish_reason
        assert "".join(d.new_text for d in deltas) == ref.new_text
        if params.logprobs is not None:
            lps = [lp for d in deltas for lp in d.logprobs]
            for x, y in zip(lps, ref.logprobs, strict=True):
                assert_lp_close(x, y, tol=1e-3)
        if params.prompt_logprobs is not None:
            pl = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
            assert len(pl) == len(prompt)
            for x, y in zip(pl[1:], ref.prompt_logprobs[1:], strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
    assert ref_engine.stats()["kv_blocks_used"] == 0


def test_preemption_recomputes_to_the_same_tokens(make_engine, tok):
    prompts = [tok.encode(t) for t in ("One two three four five six", "A B C D E F G H",
                                       "Monday, Tuesday, Wednesday")]
    params = greedy(max_tokens=20, logprobs=1)
    # 3 sequences growing to 2 blocks each: 6 > 4; greedy admission (vLLM's) takes all three,
    # where the default (projected) would run them one after another without preempting
    eng = make_engine(num_kv_blocks=4, admission="greedy")
    together = eng.generate(prompts, params)
    assert eng.stats()["num_preemptions"] > 0
    assert eng.stats()["kv_blocks_used"] == 0
    ref = make_engine(num_kv_blocks=64, enable_prefix_cache=False)
    for p, out in zip(prompts, together):
        alone = ref.generate([p], params)[0]
        assert out.new_token_ids == alone.new_token_ids and out.finish_reason == "length"
        for x, y in zip(out.logprobs, alone.logprobs, strict=True):
            assert_lp_close(x, y, tol=1e-3)


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine, tok):
    p = tok.encode("Write a short poem about the sea:")
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                            ignore_eos=True)
    eng = make_engine()
    a = eng.generate([p], params)[0]
    b = eng.generate([p], params)[0]
    assert a.new_token_ids == b.new_token_ids
    others = [tok.encode("Another prompt entirely"), tok.encode("x = 1 + ")]
    batched = eng.generate([others[0], p, others[1]],
                           [greedy(max_tokens=4), params, SamplingParams(max_tokens=4,
                                                                          seed=9)])[1]
    assert batched.new_token_ids == a.new_token_ids
    c = eng.generate([p], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50,
                                         seed=4321, ignore_eos=True))[0]
    assert c.new_token_ids != a.new_token_ids


def test_allowed_token_ids_in_sampling_and_logprobs(make_engine, tok):
    p = tok.encode("Is the sky green? Answer:")
    allowed = sorted({tok.encode(" Yes", add_special_tokens=False)[0],
                      tok.encode(" No", add_special_tokens=False)[0], 28, 1000})
    eng = make_engine()
    out = eng.generate([p], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                           allowed_token_ids=allowed, logprobs=10))[0]
    assert all(t in allowed for t in out.new_token_ids)
    for lp in out.logprobs:
        assert sorted(t for t, _ in lp.top) == allowed  # K > set: the whole set
        assert abs(sum(math.exp(v) for _, v in lp.top) - 1.0) < 1e-4
        assert lp.token_id in allowed and 1 <= lp.rank <= len(allowed)
    g = eng.generate([p], greedy(max_tokens=1, allowed_token_ids=allowed, logprobs=1,
                                 logprob_token_ids=[allowed[0], 5]))[0]
    lp = g.logprobs[0]
    assert lp.rank == 1 and lp.top[0][0] == g.new_token_ids[0]
    assert dict(lp.extra)[5] == float("-inf")  # outside the allowed set
    if allowed[0] == lp.token_id:
        assert abs(dict(lp.extra)[allowed[0]] - lp.logprob) < 1e-6


def test_allowed_mass_is_the_full_distributions_mass_on_the_set(make_engine, loaded, tok,
                                                                 monkeypatch):
    # per sampled position: log(sum over the set of softmax(logits + bias)) in fp64 from the
    # logits the engine sampled from, within 1e-5 (and from a direct forward within 1e-4, the
    # logprob tolerance above: a one-row prefill rounds its logits differently); a short set
    # (gathered by the kernel) and a large one (masked dense pass)
    seen = []  # (logits row, params, TokenLogprob) of every sampled row
    real = Sampler.sample

    def spy(self, logits, rows):
        out = real(self, logits, rows)
        seen.extend((logits[i].clone(), r.params, lp) for i, (r, (_, lp)) in
                    enumerate(zip(rows, out)))
        return out

    monkeypatch.setattr(Sampler, "sample", spy)
    p = tok.encode("Is the sky green? Answer:")
    V = loaded.config.vocab_size
    yes = tok.encode(" Yes", add_special_tokens=False)[0]
    small = sorted({yes, tok.encode(" No", add_special_tokens=False)[0], 28, 1000})
    large = list(range(0, V, 7)) + [yes]
    bias = {small[0]: 2.5, 5: -3.0}  # one inside the set, one outside: both move the mass
    eng = make_engine()
    cases = [SamplingParams(max_tokens=5, temperature=1.0, seed=11, ignore_eos=True,
                            allowed_token_ids=small, logit_bias=bias, logprobs=2),
             greedy(max_tokens=4, allowed_token_ids=large, logprobs=0),
             greedy(max_tokens=2, allowed_token_ids=small, logprobs=1, repetition_penalty=1.5)]
    outs = eng.generate([p] * len(cases), cases)

    def biased64(x, sp):
        x = x.double()
        for b, v in sp.logit_bias.items():
            x[..., b] += torch.tensor(v, dtype=torch.float32).double()
        return torch.log_softmax(x, -1)

    checked = 0
    for x, sp, lp in seen:
        if sp.allowed_token_ids is None:
            continue
        keep = torch.tensor(sp.allowed_token_ids)
        want = float(torch.logsumexp(biased64(x, sp)[keep], 0))
        assert lp.allowed_mass is not None and lp.allowed_mass <= 0
        assert abs(lp.allowed_mass - want) < 1e-5, (lp.allowed_mass, want)
        checked += 1
    assert checked == sum(len(o.new_token_ids) for o in outs) == 11
    model = loaded.model
    for sp, out in zip(cases, outs):
        seq = p + out.new_token_ids
        kv = model.make_kv_cache(8, 16)
        batch = build_forward_batch([(seq, 0, list(range(8)))], 16, all_logits=True)
        logp = biased64(model.compute_logits(model.forward(batch, kv)), sp)  # [L, V]
        keep = torch.tensor(sp.allowed_token_ids)
        for j, lp in enumerate(out.logprobs):
            row = logp[len(p) - 1 + j]
            assert abs(lp.allowed_mass - float(torch.logsumexp(row[keep], 0))) < 1e-4
            # the renormalized logprob plus the mass is the unrenormalized one
            assert abs(lp.logprob + lp.allowed_mass - float(row[lp.token_id])) < 1e-4
    plain = eng.generate([p], greedy(max_tokens=2, logprobs=1))[0]
    assert all(lp.allowed_mass is None for lp in plain.logprobs)  # no set: no mass
    scored = eng.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=0,
                                              allowed_token_ids=small))[0]
    assert all(lp is None or lp.allowed_mass is None for lp in scored.prompt_logprobs)


def test_logit_bias_stop_strings_and_penalties(make_engine, tok):
    eng = make_engine()
    p = tok.encode("Count: one, two, three, four,")
    base = eng.generate([p], greedy(max_tokens=8, logprobs=0))[0]
    forced = base.new_token_ids[0] ^ 1
    biased = eng.generate([p], greedy(max_tokens=1, logit_bias={forced: 100.0}, logprobs=0))[0]
    assert biased.new_token_ids == [forced] and biased.logprobs[0].rank == 1
    assert biased.logprobs[0].logprob > -1e-3  # after the bias it is all the mass
    cut = eng.generate([p], greedy(max_tokens=8, stop=[","]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == ","
    assert "," not in cut.new_text and base.new_text.startswith(cut.new_text)
    keep = eng.generate([p], greedy(max_tokens=8, stop=[","], include_stop_str_in_output=True))[0]
    assert keep.new_text == cut.new_text + ","
    rep = tok.encode("the the the the the the the the")
    plain = eng.generate([rep], greedy(max_tokens=6, logprobs=0))[0]
    pen = eng.generate([rep], greedy(max_tokens=6, logprobs=0, repetition_penalty=1.8,
                                     frequency_penalty=1.0))[0]
    assert pen.new_token_ids != plain.new_token_ids
    assert pen.logprobs[0].logprob <= 0  # logprobs stay the model's, not the penalised ones


def test_eos_min_tokens_and_validation(make_engine, loaded, tok):
    eng = make_engine()
    eos = loaded.eos_token_ids[0]
    p = tok.encode("Say hi.")
    out = eng.generate([p], greedy(max_tokens=5, ignore_eos=False, min_tokens=3,
                                   logit_bias={eos: 100.0}))[0]
    # min_tokens=3: three tokens that cannot be EOS, then the (biased) EOS ends it
    assert len(out.new_token_ids) == 4 and out.new_token_ids[-1] == eos
    assert eos not in out.new_token_ids[:3]
    assert out.finish_reason == "stop"
    out = eng.generate([p], greedy(max_tokens=4, stop_token_ids=[eos], ignore_eos=True,
                                   logit_bias={eos: 100.0}))[0]
    assert out.new_token_ids == [eos] and out.stop_reason == eos
    with pytest.raises(InvalidRequest):
        eng.add_request([], greedy(), "x", print)
    with pytest.raises(InvalidRequest):
        eng.add_request([49152], greedy(), "x", print)
    with pytest.raises(ContextTooLong):
        eng.add_request([1] * 10, greedy(max_tokens=eng.limits.max_model_len), "x", print)
    with pytest.raises(InvalidRequest):
        eng.add_request([1], greedy(logprobs=21), "x", print)


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(make_engine, tok):
    eng = make_engine()
    real = eng.runner.execute
    calls = []

    def flaky(out):
        calls.append(len(out.scheduled))
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(out)

    eng.runner.execute = flaky
    p = tok.encode("Hello there")
    bad = eng.generate([p], greedy(max_tokens=3))[0]
    assert bad.finished and bad.finish_reason == "error" and "injected" in bad.error
    good = eng.generate([p], greedy(max_tokens=3))[0]
    assert good.finish_reason == "length" and len(good.new_token_ids) == 3
    st = eng.stats()
    assert st["step_errors_total"] == 1 and st["kv_blocks_used"] == 0 and eng.is_alive()


def record_steps(eng) -> list[int]:
    """The number of sequences in each step the engine runs from now on (appended as it runs)."""
    steps: list[int] = []
    real = eng.runner.execute
    eng.runner.execute = lambda out: steps.append(len(out.scheduled)) or real(out)
    return steps


def test_an_idle_engine_admits_a_burst_into_one_step(make_engine, tok):
    """Requests arriving a few ms apart at an idle engine share one step (Engine._await_burst);
    a lone request waits one quiet gap (1 s here), not the whole window (5 s)."""
    eng = make_engine(arrival_window_ms=5000, arrival_gap_ms=1000)
    steps = record_steps(eng)
    prompts = [tok.encode(f"Review {i}: fine.\nSentiment:") for i in range(4)]
    done = [threading.Event() for _ in prompts]

    def submit(i):
        eng.add_request(prompts[i], greedy(max_tokens=1), f"burst-{i}",
                        lambda out, i=i: out.finished and done[i].set())

    for i in range(4):  # 50 ms apart: well inside the gap
        submit(i)
        time.sleep(0.05)
    assert all(d.wait(60) for d in done)
    assert steps == [4]

    time.sleep(0.5)  # past the wait for the burst's replacements (a quarter of its step)
    start = time.monotonic()
    lone = eng.generate([prompts[0]], greedy(max_tokens=1))[0]
    assert lone.finished and steps[-1] == 1
    assert 1.0 <= time.monotonic() - start < 4.5


def test_replacements_of_finished_requests_share_one_step(make_engine, tok, monkeypatch):
    """A client with 2 in flight sends each finished request's successor at its own pace (here
    0.1 s and 0.4 s after the finish, further apart than the 50 ms burst gap): the engine waits
    for both and runs them in one step, instead of one step each (Engine._await_arrivals)."""
    import freetoken.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "REPLACEMENT_WAIT_FRACTION", 1e9)  # the window decides
    eng = make_engine(arrival_window_ms=3000, arrival_gap_ms=50)
    steps = record_steps(eng)
    prompts = [tok.encode(f"Review {i}: fine.\nSentiment:") for i in range(4)]
    done = [threading.Event() for _ in prompts]

    def submit(i):
        def sink(out, i=i):
            if out.finished:
                done[i].set()
                if i < 2:  # the successor, sent later from another thread (as a client would)
                    threading.Timer(0.1 + 0.3 * i, submit, (i + 2,)).start()
        eng.add_request(prompts[i], greedy(max_tokens=1), f"r-{i}", sink)

    submit(0)
    submit(1)
    assert all(d.wait(60) for d in done)
    assert steps == [2, 2]


def test_the_wait_for_replacements_is_bounded(make_engine, tok, monkeypatch):
    """No successor comes: a running stream stalls once, for the window, then runs on."""
    import freetoken.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "REPLACEMENT_WAIT_FRACTION", 1e9)
    eng = make_engine(arrival_window_ms=300, arrival_gap_ms=200)
    gaps, last = [], [None]
    real = eng.runner.execute

    def timed(out):
        if last[0] is not None:
            gaps.append(time.monotonic() - last[0])
        try:
            return real(out)
        finally:
            last[0] = time.monotonic()

    eng.runner.execute = timed
    short = tok.encode("Hi")
    outs = eng.generate([short, short], [greedy(max_tokens=1), greedy(max_tokens=8)])
    assert [len(o.new_token_ids) for o in outs] == [1, 8]
    stalls = [g for g in gaps if g >= 0.25]
    assert len(stalls) == 1 and stalls[0] < 2.0 and gaps.index(stalls[0]) == 0
