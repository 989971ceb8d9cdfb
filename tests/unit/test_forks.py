"""Forks in the scheduler (scoring's shared query and items), with a fake runner that keeps what
every KV slot holds: a sequence is only ever computed over slots that hold exactly its own
tokens, whether they came from its parent (by reference or copied), the prefix cache or itself.
"""

from __future__ import annotations

import random

import pytest

from freetoken.engine.kv_cache import BlockPool
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduler, StepResult
from freetoken.engine.sequence import Sequence

BS = 16


def next_token(ctx) -> int:
    return 1 + (sum(ctx) * 31 + len(ctx) * 7) % 96


class KVRunner:
    """Writes each computed token's id into its KV slot and checks, before every chunk, that the
    slots below the chunk hold the sequence's own ids."""

    def __init__(self):
        self.slots: dict[int, list] = {}
        self.computed: dict[str, int] = {}  # request id -> tokens it computed itself
        self.starts: dict[str, list[int]] = {}

    def __call__(self, out):
        for src, dst, m in out.copies:
            self.slots.setdefault(dst, [None] * BS)[:m] = self.slots[src][:m]
        results = []
        for item in out.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            table = seq.block_table
            for p in range(start):
                got = self.slots.get(table[p // BS], [None] * BS)[p % BS]
                assert got == seq.token_ids[p], (seq.request_id, p)
            for p in range(start, start + n):
                self.slots.setdefault(table[p // BS], [None] * BS)[p % BS] = seq.token_ids[p]
            rid = seq.request_id
            self.computed[rid] = self.computed.get(rid, 0) + n
            self.starts.setdefault(rid, []).append(start)
            res = StepResult()
            if item.sample:
                res.token_id = next_token(seq.token_ids[:start + n])
                res.logprob = TokenLogprob(res.token_id, -1.0, 1)
            res.prompt_logprobs = [TokenLogprob(seq.token_ids[q + 1], -float(q), 1)
                                   for q in range(item.pl_start, item.pl_end)]
            results.append(res)
        return results


def make(num_blocks=64, max_num_seqs=8, budget=256, cache=True):
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=cache, fingerprint=b"fake")
    return Scheduler(pool, max_num_seqs, budget, 1024, eos_token_ids=[0],
                     enable_partial_reuse=True)


def seq(rid, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_tokens", 1)
    return Sequence(str(rid), list(prompt), SamplingParams(**kw), seed=0, sink=lambda o: None)


def run_all(sched, runner, max_steps=10_000):
    for _ in range(max_steps):
        if not sched.has_work():
            return
        out = sched.schedule()
        assert out.scheduled, "no progress: deadlock"
        results = runner(out)
        sched.release_pins(out)
        for s in sched.update(out, results):
            s.take_output()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("cache", [True, False])
def test_children_share_the_parents_kv_and_compute_only_their_own_tokens(cache):
    sched, runner = make(cache=cache), KVRunner()
    parent = seq("p", range(1, 41), max_tokens=1)  # 2 full blocks + 8 in a partial one
    kids = [seq(f"c{j}", [*range(1, 41), 50 + j, 60 + j, 70], max_tokens=0,
                prompt_logprobs=0, prompt_logprobs_start=41) for j in range(5)]
    sched.add(parent)
    for k in kids:
        sched.add(k, fork_from="p")
    assert parent.num_fork_children == 5
    run_all(sched, runner)
    assert runner.computed["p"] == 40
    for k in kids:
        assert runner.computed[k.request_id] == 3 and runner.starts[k.request_id] == [40]
        assert k.num_cached_tokens == 40 and k.finish_reason == "length"
    assert sched.held == [] and sched.pool.num_free_blocks == 64
    # only the label positions were scored: the rest are None, never computed
    k = seq("k", [*range(1, 41), 51, 61, 70], max_tokens=0, prompt_logprobs=0,
            prompt_logprobs_start=41)
    sched.add(k, fork_from="gone")  # an unknown parent: a plain sequence
    run_all(sched, runner)
    assert k.fork is None


def test_a_finished_parent_is_held_until_its_last_child_is_admitted():
    sched, runner = make(max_num_seqs=2), KVRunner()
    parent = seq("p", range(1, 30))
    kids = [seq(f"c{j}", [*range(1, 30), 40 + j], max_tokens=0) for j in range(4)]
    sched.add(parent)
    for k in kids:
        sched.add(k, fork_from="p")
    held_seen = False
    while sched.has_work():
        out = sched.schedule()
        results = runner(out)
        sched.release_pins(out)
        sched.update(out, results)
        if parent.is_finished and parent.num_fork_children:
            assert sched.held == [parent] and parent.block_table  # its blocks wait
            held_seen = True
    assert held_seen and parent.num_fork_children == 0 and sched.held == []
    assert all(runner.computed[k.request_id] == 1 for k in kids)
    assert sched.pool.num_free_blocks == 64


def test_children_of_an_aborted_parent_compute_for_themselves():
    sched, runner = make(cache=False), KVRunner()
    parent = seq("p", range(1, 30))
    kids = [seq(f"c{j}", [*range(1, 30), 40 + j]) for j in range(3)]
    sched.add(parent)
    for k in kids:
        sched.add(k, fork_from="p")
    sched.abort("p")
    run_all(sched, runner)
    for k in kids:
        assert runner.computed[k.request_id] == 30 and k.fork is None
        assert k.output_ids == [next_token(k.token_ids[:30])]
    assert sched.pool.num_free_blocks == 64


def test_held_blocks_give_way_under_pressure():
    # 4 blocks: the parent (2) and its first child fit; the held parent must let go for others
    sched, runner = make(num_blocks=4, max_num_seqs=1), KVRunner()
    parent = seq("p", range(1, 21))
    kids = [seq(f"c{j}", [*range(1, 21), *([50 + j] * 20)], max_tokens=2) for j in range(3)]
    sched.add(parent)
    for k in kids:
        sched.add(k, fork_from="p")
    run_all(sched, runner)
    for k in kids:
        assert k.output_ids == [next_token(k.token_ids[:40]), next_token(k.token_ids[:41])]
    assert sched.pool.num_free_blocks == 4 and sched.held == []


@pytest.mark.parametrize("cache", [True, False])
def test_random_scoring_trees_under_pressure(cache):
    rng = random.Random(7)
    for trial in range(12):
        sched = make(num_blocks=rng.choice([12, 24, 64]), max_num_seqs=rng.choice([2, 5, 16]),
                     budget=rng.choice([24, 64, 256]), cache=cache)
        runner = KVRunner()
        query = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 40))]
        seqs = []
        sched.add(root := seq(f"{trial}q", query, max_tokens=0))
        seqs.append(root)
        for i in range(rng.randrange(1, 6)):
            item = query + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 20))]
            sched.add(s := seq(f"{trial}i{i}", item), fork_from=root.request_id)
            seqs.append(s)
            for j in range(rng.randrange(0, 4)):
                label = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 5))]
                sched.add(c := seq(f"{trial}i{i}l{j}", item + label, max_tokens=0,
                                   prompt_logprobs=0, prompt_logprobs_start=len(item) + 1),
                          fork_from=s.request_id)
                seqs.append(c)
        if rng.random() < 0.3:
            sched.abort(root.request_id)
        run_all(sched, runner)
        for s in seqs:
            if s.finish_reason == "abort":
                continue
            n = s.num_prompt_tokens
            assert s.output_ids == ([next_token(s.token_ids[:n])] if s.params.max_tokens else [])
        assert sched.held == [] and sched.pool.num_free_blocks == sched.pool.num_blocks
