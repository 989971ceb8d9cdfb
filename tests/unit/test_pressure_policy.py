"""The KV-pressure policy (engine/pressure.py) in the scheduler, with a fake runner: projected
admission, short work past long work, priority, paused sequences, preemption causes, and that
every sequence still ends with the tokens it would have alone and every block comes back."""

from __future__ import annotations

import random

import pytest

from freetoken.engine.kv_cache import BlockPool
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.pressure import PressurePolicy, projected_peak
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduler, StepResult
from freetoken.engine.sequence import Sequence, SequenceStatus

BS = 16
ON = PressurePolicy(projected=True, watermark=0.01, short_reserve=0.1, short_max_tokens=4,
                    growth_horizon=8)


def next_token(ctx) -> int:
    return 1 + (sum(ctx) * 31 + len(ctx) * 7) % 96


def expected_output(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


def runner(out):
    results = []
    for item in out.scheduled:
        res = StepResult()
        if item.sample:
            res.token_id = next_token(item.seq.token_ids[:item.start + item.num_new_tokens])
            res.logprob = TokenLogprob(res.token_id, -1.0, 1)
        results.append(res)
    return results


def make(policy=ON, num_blocks=64, max_num_seqs=8, budget=256, max_model_len=1024):
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=True, fingerprint=b"fake")
    return Scheduler(pool, max_num_seqs, budget, max_model_len, eos_token_ids=[0], policy=policy)


def seq(rid, n_prompt, max_tokens, priority=0, ignore_eos=True, seed=0):
    rng = random.Random(f"{rid}-{seed}")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                            priority=priority)
    return Sequence(str(rid), [rng.randrange(1, 90) for _ in range(n_prompt)], params, seed=0,
                    sink=lambda o: None)


def step(sched):
    """One step; returns (ids scheduled, sequences finished)."""
    out = sched.schedule()
    assert out.num_tokens <= sched.max_num_batched_tokens
    done = [s for s in sched.update(out, runner(out)) if s.is_finished]
    return [item.seq.request_id for item in out.scheduled], done


def run_all(sched, max_steps=20_000):
    for _ in range(max_steps):
        if not sched.has_work():
            return
        ids, _ = step(sched)
        assert ids, "no progress: deadlock"
    raise AssertionError("did not finish")


def check_done(sched, seqs):
    for s in seqs:
        assert s.is_finished and s.finish_reason == "length", s.request_id
        assert s.output_ids == expected_output(s.token_ids[:s.num_prompt_tokens],
                                               s.params.max_tokens)
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_projected_peak_is_the_fullest_moment():
    # lengths 10 and 40, remaining 30 and 100 (ignore_eos: exact): before the first finishes
    # (t=30) both hold ceil(40/16)+ceil(70/16) = 3+5 = 8; before the second, ceil(140/16) = 9
    a, b = seq("a", 10, 30), seq("b", 40, 100)
    assert projected_peak([a, b], BS, ON, 1024) == 9
    c = seq("c", 10, 1000, ignore_eos=False)  # may stop at any token: the horizon only
    assert projected_peak([c], BS, ON, 1024) == 2  # ceil((10 + 8) / 16)
    assert ON.is_short(seq("s", 10, 4)) and not ON.is_short(seq("l", 10, 5))


@pytest.mark.parametrize("policy", [ON, PressurePolicy()])
def test_long_generations_fill_the_pool_and_all_finish(policy):
    # 12 generations of 200 tokens in 64 blocks: at most ~4 fit to their end
    sched = make(policy)
    seqs = [seq(i, 20 + i, 200) for i in range(12)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    check_done(sched, seqs)
    if policy.projected:  # admitted only with room to finish: nothing is ever recomputed
        assert sched.stats.preemptions["kv"] == 0
    else:  # the plain policy (vLLM's) thrashes on the same load
        assert sched.stats.preemptions["kv"] > 0


def test_one_token_request_gets_through_while_long_generations_fill_the_pool():
    sched = make(num_blocks=48, max_num_seqs=4)
    longs = [seq(i, 30, 300) for i in range(10)]
    for s in longs:
        sched.add(s)
    for _ in range(150):  # the pool and the seats are full of long work, more of it waits
        step(sched)
    assert sum(s.status is SequenceStatus.WAITING for s in longs) >= 5
    short = seq("short", 40, 1)
    sched.add(short)
    for n in range(1, 3):
        _, done = step(sched)
        if short in done:
            break
    assert short.is_finished and n <= 2
    run_all(sched)
    check_done(sched, [*longs, short])


def test_short_work_preempts_only_long_work_of_no_better_priority():
    sched = make(max_num_seqs=2)
    a, b = seq("a", 20, 100, priority=-1), seq("b", 20, 100)
    sched.add(a)
    sched.add(b)
    step(sched)
    s1 = seq("s1", 20, 1)  # no seat: b (long, same priority) gives way, a (better) stays
    sched.add(s1)
    ids, _ = step(sched)
    assert "s1" in ids and "a" in ids and "b" not in ids
    assert sched.stats.preemptions["short"] == 1 and b.status is SequenceStatus.WAITING
    s2 = seq("s2", 20, 1, priority=1)  # a worse priority than every long one: it waits
    sched.add(s2)
    ids, _ = step(sched)
    assert "s2" not in ids and sched.stats.preemptions["short"] == 1
    run_all(sched)
    check_done(sched, [a, b, s1, s2])


def test_priority_orders_admission_and_preempts_a_worse_one():
    sched = make(max_num_seqs=1)
    low, mid = seq("low", 20, 50, priority=5), seq("mid", 20, 50, priority=0)
    sched.add(low)
    step(sched)
    high = seq("high", 20, 50, priority=-5)
    sched.add(mid)
    sched.add(high)
    ids, _ = step(sched)  # high takes low's seat (vLLM's priority preemption)
    assert ids == ["high"] and sched.stats.preemptions["priority"] == 1
    assert [s.request_id for s in sched.waiting] == ["mid", "low"]
    run_all(sched)
    check_done(sched, [low, mid, high])


def test_paused_sequences_are_not_scheduled_and_give_their_kv_first():
    sched = make(num_blocks=19, max_num_seqs=4)
    a, b = seq("a", 100, 150), seq("b", 40, 60)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.set_paused("a", True) and sched.num_paused == 1
    for _ in range(3):
        ids, _ = step(sched)
        assert ids == ["b"]
    assert not sched.set_paused("nobody", True)
    c = seq("c", 40, 150)  # needs more blocks than are free: a's go first
    sched.add(c)
    for _ in range(150):
        step(sched)
    assert sched.stats.preemptions["paused"] >= 1 and a.status is SequenceStatus.WAITING
    sched.set_paused("b", True)
    sched.set_paused("c", True)
    assert not sched.has_work()  # nothing to compute: the engine sleeps on its inbox
    for rid in ("a", "b", "c"):
        sched.set_paused(rid, False)
    run_all(sched)
    check_done(sched, [a, b, c])


def test_queue_time_is_recorded_by_size():
    sched = make()
    sched.add(seq("l", 20, 50))
    sched.add(seq("s", 20, 1))
    run_all(sched)
    hist = sched.stats.queue_histograms()
    assert hist["long"][0][-1] == ("+Inf", 1) and hist["short"][0][-1] == ("+Inf", 1)


def test_random_load_matches_alone_under_every_policy():
    rng = random.Random(7)
    for policy in (ON, PressurePolicy(), PressurePolicy(short_max_tokens=4, short_reserve=0.2)):
        sched = make(policy, num_blocks=40, max_num_seqs=6, budget=96)
        seqs = []
        for i in range(40):
            s = seq(i, rng.randrange(1, 120), rng.choice([0 + 1, 2, 4, 30, 150]),
                    priority=rng.choice([0, 0, 1, -1]), ignore_eos=rng.random() < 0.5)
            seqs.append(s)
            sched.add(s)
            if rng.random() < 0.3:
                sched.set_paused(s.request_id, True)
            for _ in range(rng.randrange(0, 4)):
                if sched.has_work():
                    step(sched)
        for s in seqs:
            sched.set_paused(s.request_id, False)
        run_all(sched)
        for s in seqs:
            assert s.is_finished
            n = s.num_output_tokens
            assert s.output_ids == expected_output(s.token_ids[:s.num_prompt_tokens], n)
        assert sched.pool.num_free_blocks == sched.pool.num_blocks
