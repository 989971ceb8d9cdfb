"""Scheduler with a fake runner (no model): chunked prefill, budgets, admission hold, preemption
and recompute, abort, and the finish rules of Sequence.append_token."""

from __future__ import annotations

import random

import pytest

from freetoken.engine.kv_cache import BlockPool
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduler, StepResult
from freetoken.engine.sequence import Sequence, SequenceStatus

BS = 16
EOS = 0


def next_token(ctx) -> int:
    """A deterministic 'model': the next token depends on the whole context only."""
    return 1 + (sum(ctx) * 31 + len(ctx) * 7) % 96


class FakeRunner:
    def __init__(self):
        self.steps = []

    def __call__(self, out):
        self.steps.append([(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled])
        results = []
        for item in out.scheduled:
            seq = item.seq
            end = item.start + item.num_new_tokens
            res = StepResult()
            if item.sample:
                res.token_id = next_token(seq.token_ids[:end])
                res.logprob = TokenLogprob(res.token_id, -1.0, 1)
            res.prompt_logprobs = [
                TokenLogprob(seq.token_ids[q + 1], -float(q), 1)
                for q in range(item.pl_start, item.pl_end)
            ]
            results.append(res)
        return results


class CharDetok:
    def push(self, ids):
        return "".join(chr(ord("a") + (i % 26)) for i in ids)

    def flush(self):
        return ""


def make(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, cache=True, partial=True):
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=cache, fingerprint=b"fake")
    return Scheduler(pool, max_num_seqs, budget, max_model_len, eos_token_ids=[EOS],
                     enable_partial_reuse=partial)


def new_seq(rid, prompt, detok=False, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return Sequence(
        str(rid),
        prompt,
        SamplingParams(**kw),
        seed=0,
        sink=lambda o: None,
        detokenizer=CharDetok() if detok else None,
    )


def run_all(sched, runner, max_steps=10_000):
    finished = []
    for _ in range(max_steps):
        if not sched.has_work():
            return finished
        out = sched.schedule()
        assert out.scheduled, "no progress: deadlock"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        results = runner(out)
        sched.release_pins(out)
        for seq in sched.update(out, results):
            seq.take_output()
            if seq.is_finished:
                finished.append(seq)
    raise AssertionError("did not finish")


def expected_output(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


def test_chunked_prefill_then_decode():
    sched, runner = make(budget=32), FakeRunner()
    seq = new_seq(1, list(range(1, 81)), max_tokens=3)
    sched.add(seq)
    run_all(sched, runner)
    assert runner.steps == [
        [("1", 0, 32)],
        [("1", 32, 32)],
        [("1", 64, 16)],
        [("1", 80, 1)],
        [("1", 81, 1)],
    ]
    assert seq.output_ids == expected_output(range(1, 81), 3)
    assert seq.finish_reason == "length"
    assert sched.pool.num_free_blocks == 64


def test_decodes_first_then_admission_and_max_num_seqs():
    sched, runner = make(budget=40, max_num_seqs=2), FakeRunner()
    a, b, c = (new_seq(i, [i + 1] * 30, max_tokens=2) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    run_all(sched, runner)
    assert runner.steps[0] == [("0", 0, 30), ("1", 0, 10)]
    assert runner.steps[1] == [("0", 30, 1), ("1", 10, 20)]  # decode first, then the chunk
    assert all(len(step) <= 2 for step in runner.steps)
    for s in (a, b, c):
        assert s.output_ids == expected_output(s.token_ids[:30], 2)


def test_prefix_hit_usage_and_prompt_logprob_ranges():
    sched, runner = make(), FakeRunner()
    shared = list(range(1, 41))  # 2 full blocks + 8
    a = new_seq("a", shared + [50, 51], max_tokens=1)
    sched.add(a)
    run_all(sched, runner)
    b = new_seq("b", shared + [60, 61, 62], max_tokens=1, prompt_logprobs=1)
    sched.add(b)
    out = sched.schedule()
    item = out.scheduled[0]
    assert (item.start, item.num_new_tokens) == (32, 11)  # 2 blocks from the cache
    assert (item.pl_start, item.pl_end) == (0, 42)  # cached positions 0..31 included
    for seq in sched.update(out, runner(out)):
        delta = seq.take_output()
    assert delta.num_cached_tokens == 32 and b.num_cached_tokens == 32
    assert delta.prompt_logprobs[0] is None
    assert [lp.token_id for lp in delta.prompt_logprobs[1:]] == b.token_ids[1:43]
    assert sched.pool.num_query_tokens == 42 + 43 and sched.pool.num_hit_tokens == 32


def test_partial_block_hit_copies_and_pins_the_donor():
    sched, runner = make(), FakeRunner()
    shared = list(range(1, 41))  # 2 full blocks + 8 ids
    a = new_seq("a", shared + list(range(60, 70)), max_tokens=1)  # block 2 full: indexed
    sched.add(a)
    run_all(sched, runner)
    b = new_seq("b", shared + [90, 91, 92], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    item = out.scheduled[0]
    assert (item.start, item.num_new_tokens) == (40, 3)  # 32 from full blocks + 8 copied
    (src, dst, m), = out.copies
    assert m == 8 and dst == b.block_table[2] and out.pinned == [src]
    assert sched.pool.ref_count(src) == 1  # pinned for the step only
    results = runner(out)
    sched.release_pins(out)
    assert sched.pool.ref_count(src) == 0
    sched.update(out, results)
    assert b.num_cached_tokens == 40 and b.output_ids == expected_output(b.token_ids[:43], 1)
    assert sched.pool.num_hit_tokens == 40
    off, runner = make(), FakeRunner()
    off.enable_partial_reuse = False
    off.add(new_seq("a", shared + list(range(60, 70)), max_tokens=1))
    run_all(off, runner)
    off.add(new_seq("b", shared + [90, 91, 92], max_tokens=1))
    out = off.schedule()
    assert out.copies == [] and out.scheduled[0].start == 32


def test_prompts_arriving_together_compute_a_shared_prefix_once():
    sched, runner = make(budget=512), FakeRunner()
    shared = list(range(1, 50))  # 3 full blocks + 1
    seqs = [new_seq(i, shared + [60 + i] * 5, max_tokens=1) for i in range(4)]
    other = new_seq("x", [7] * 20, max_tokens=1)
    for s in seqs + [other]:
        sched.add(s)
    out = sched.schedule()
    # the first computes the prefix; the others step aside, an unrelated prompt goes ahead
    assert [s.seq.request_id for s in out.scheduled] == ["0", "x"]
    results = runner(out)
    sched.release_pins(out)
    sched.update(out, results)
    out = sched.schedule()
    # 3 full blocks from the cache (the 4th block of "0" is not full, so not indexed)
    assert [(s.seq.request_id, s.start) for s in out.scheduled] == [("1", 48), ("2", 48),
                                                                    ("3", 48)]
    run_all(sched, runner)
    assert [s.num_cached_tokens for s in seqs] == [0, 48, 48, 48]
    for s in seqs:
        assert s.output_ids == expected_output(s.token_ids[:54], 1)


def test_preemption_recomputes_and_never_drops():
    # 12 blocks for 6 sequences that each grow to 4 blocks: preemption is unavoidable
    sched, runner = (
        make(num_blocks=12, max_num_seqs=6, budget=64, max_model_len=12 * BS),
        FakeRunner(),
    )
    rng = random.Random(0)
    seqs = [
        new_seq(i, [rng.randrange(1, 90) for _ in range(20 + i)], max_tokens=30) for i in range(6)
    ]
    for s in seqs:
        sched.add(s)
    finished = run_all(sched, runner)
    assert len(finished) == 6
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.output_ids == expected_output(s.token_ids[: s.num_prompt_tokens], 30)
        assert s.finish_reason == "length"
    assert sched.pool.num_free_blocks == 12


def test_admission_held_when_pool_is_full():
    sched, runner = make(num_blocks=4, budget=128, max_model_len=64), FakeRunner()
    a = new_seq("a", [1] * 40, max_tokens=2)  # 3 blocks
    b = new_seq("b", [2] * 40, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert b.status is SequenceStatus.WAITING
    sched.update(out, runner(out))
    run_all(sched, runner)
    assert a.is_finished and b.is_finished
    assert sched.pool.num_free_blocks == 4


def test_abort_frees_blocks_running_and_waiting():
    sched, runner = make(num_blocks=8, max_num_seqs=1), FakeRunner()
    a, b = new_seq("a", [1] * 20, max_tokens=50), new_seq("b", [2] * 20, max_tokens=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, runner(out))
    assert sched.pool.num_used_blocks == 2
    assert sched.abort("a") is a and a.finish_reason == "abort"
    assert sched.abort("b") is b
    assert sched.abort("nope") is None
    assert sched.pool.num_free_blocks == 8 and not sched.has_work()


def feed(seq, tokens, max_model_len=1000):
    for t in tokens:
        if seq.append_token(t, None, {EOS}, max_model_len):
            break
    return seq


def test_finish_rules():
    s = feed(new_seq(1, [5], ignore_eos=False, max_tokens=10), [3, EOS, 4])
    assert (s.finish_reason, s.stop_reason, s.output_ids) == ("stop", None, [3, EOS])
    s = feed(new_seq(1, [5], ignore_eos=True, max_tokens=3), [EOS, EOS, EOS, EOS])
    assert (s.finish_reason, s.output_ids) == ("length", [EOS] * 3)
    s = feed(new_seq(1, [5], ignore_eos=False, min_tokens=2, max_tokens=5), [EOS, EOS, 7])
    assert (s.finish_reason, s.output_ids) == ("stop", [EOS, EOS])
    s = feed(new_seq(1, [5], stop_token_ids=[9], max_tokens=5), [1, 9, 2])
    assert (s.finish_reason, s.stop_reason, s.output_ids) == ("stop", 9, [1, 9])
    s = feed(new_seq(1, [5] * 8, max_tokens=50), [1] * 10, max_model_len=10)
    assert (s.finish_reason, s.num_tokens) == ("length", 10)


def test_stop_strings_cut_held_back_and_included():
    # ids 0..25 decode to a..z
    s = new_seq(1, [5], detok=True, stop=["cd"], max_tokens=20)
    feed(s, [0, 1])  # "ab"
    d = s.take_output()
    assert d.new_text == "a"  # the last len("cd") - 1 characters are held back
    feed(s, [2, 3, 4])  # "cd" -> stop
    d = s.take_output()
    assert (d.new_text, d.finished, d.stop_reason) == ("b", True, "cd")
    assert s.text == "ab"
    s = new_seq(1, [5], detok=True, stop=["cd"], include_stop_str_in_output=True, max_tokens=20)
    feed(s, [0, 1, 2, 3, 4])
    assert s.text == "abcd" and s.take_output().new_text == "abcd"
    # a stop string inside one token's text, and min_tokens ignores earlier stops
    s = new_seq(1, [5], detok=True, stop=["b"], min_tokens=2, max_tokens=20)
    feed(s, [1, 0, 1])
    assert s.text == "ba" and s.output_ids == [1, 0, 1]


@pytest.mark.parametrize("cache", [True, False])
def test_many_random_requests_match_one_at_a_time(cache):
    rng = random.Random(1)
    prefix = [rng.randrange(1, 90) for _ in range(50)]
    prompts = [
        prefix[: rng.randrange(0, 50)] + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 40))]
        for _ in range(24)
    ]
    sched, runner = make(num_blocks=24, max_num_seqs=6, budget=48, cache=cache), FakeRunner()
    seqs = [new_seq(i, p, max_tokens=rng.randrange(1, 20)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    run_all(sched, runner)
    for s in seqs:
        assert s.output_ids == expected_output(
            s.token_ids[: s.num_prompt_tokens], s.params.max_tokens
        )
    assert sched.pool.num_free_blocks == 24
