"""The KV-pressure policy the scheduler applies: which work is short, whether a long sequence may
be admitted, which running sequence gives way, and the counts /metrics shows for it.

Policy (docs/api.md, "Under load"):
  * Order: lower `priority` first (vLLM's field, default 0), then arrival.
  * Short work -- max_tokens <= short_max_tokens, which covers scoring (0 or 1 token) -- needs at
    most a few steps. It may pass a long sequence that does not fit, it may use the KV reserve
    (short_reserve of the pool, kept free by long admissions), and when it finds no seat or no
    blocks it preempts the newest long running sequence of no better priority. Its cost to the
    victim is small: the victim's full blocks stay in the prefix cache, and the short request
    frees its seat and blocks a few steps later.
  * A long sequence is admitted only while the running set's projected KV peak still fits the
    pool, less the watermark and the reserve (`projected_peak`): sequences whose length is known
    (ignore_eos) count to their end, the others `growth_horizon` tokens ahead. Admitting more
    would only buy preemptions later: each recomputes work already done.
  * A stream whose client stops reading is paused (not scheduled); its KV is the first to go.

What it is not: the scheduling loop itself (scheduler.py).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

# Queue-time histogram buckets, seconds (as the edge's latency histograms)
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CAUSES = ("kv", "short", "priority", "paused")  # why a sequence was preempted


@dataclass(frozen=True, slots=True)
class PressurePolicy:
    """The knobs (EngineConfig carries them). The default is the plain policy: FCFS admission
    while blocks are free, preemption of the newest sequence when the pool runs out."""
    projected: bool = False       # admit a long sequence only when the projected peak fits
    watermark: float = 0.0        # share of the pool a long admission leaves free (vLLM: 0.01)
    short_reserve: float = 0.0    # share of the pool only short work may take at admission
    short_max_tokens: int = -1    # max_tokens <= this is short work (-1: nothing is)
    growth_horizon: int = 8       # tokens ahead projected for a sequence that may stop early

    def is_short(self, seq) -> bool:
        return seq.params.max_tokens <= self.short_max_tokens

    def long_headroom(self, num_blocks: int) -> int:
        """Blocks a long admission must leave free."""
        return int(num_blocks * self.watermark) + int(num_blocks * self.short_reserve)

    def remaining(self, seq, max_model_len: int) -> int:
        """Tokens the sequence will still add: exactly when its length is known, else at most
        growth_horizon."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        if not seq.params.ignore_eos:
            left = min(left, max(self.growth_horizon,
                                 seq.params.min_tokens - seq.num_output_tokens))
        return max(0, left)


def projected_peak(seqs: Iterable, block_size: int, policy: PressurePolicy,
                   max_model_len: int) -> int:
    """The most blocks these sequences will hold at once if each decodes one token a step and
    gives its blocks back when done: the peak is just before one of them finishes, so it is
    the max over j of sum_{i: r_i >= r_j} ceil((len_i + r_j) / block_size)."""
    items = sorted(((policy.remaining(s, max_model_len), s.num_tokens) for s in seqs),
                   reverse=True)
    peak = 0
    for k, (r, _) in enumerate(items, start=1):
        peak = max(peak, sum(-(-(length + r) // block_size) for _, length in items[:k]))
    return peak


def admits_long(policy: PressurePolicy, seq, active: list, pool, chunk_blocks: int,
                max_model_len: int) -> bool:
    """A long sequence's admission test: it leaves the watermark and the short reserve free,
    and (policy.projected) the projected KV peak of the `active` (running, unpaused) sequences
    with it fits the rest. With nothing active it always passes, so the oldest work runs.
    NOTE: held parents' and paused sequences' blocks are not counted: they are given up before
    any running work is."""
    if not active:
        return True
    headroom = policy.long_headroom(pool.num_blocks)
    if not policy.projected:
        return pool.num_free_blocks - chunk_blocks >= headroom
    peak = projected_peak([*active, seq], pool.block_size, policy, max_model_len)
    return peak <= pool.num_blocks - headroom


def displacement(policy: PressurePolicy, seq, victim, pool=None) -> str | None:
    """Why the running `victim` gives way to the waiting `seq` ("priority", "short"), or None.
    For blocks (`pool` given), short work displaces only while it fits the short reserve: a
    big prompt would cost its victims more recompute than it saves; it waits its turn."""
    if victim.priority > seq.priority:
        return "priority"
    if not policy.is_short(seq) or policy.is_short(victim) or victim.priority < seq.priority:
        return None
    if pool is not None:
        reserve = max(1, int(pool.num_blocks * policy.short_reserve))
        if -(-seq.num_tokens // pool.block_size) > reserve:
            return None
    return "short"


class PressureStats:
    """Preemptions by cause and queue time (arrival to first admission) by request size."""

    def __init__(self):
        self.preemptions = dict.fromkeys(CAUSES, 0)
        # size -> (bucket counts (cumulative at export), sum of seconds, count)
        self.queue = {size: [[0] * len(QUEUE_BUCKETS), 0.0, 0] for size in ("short", "long")}

    def preempted(self, cause: str) -> None:
        self.preemptions[cause] += 1

    def admitted(self, seq, short: bool) -> None:
        wait = max(0.0, time.monotonic() - seq.queued_at)
        entry = self.queue["short" if short else "long"]
        i = bisect_left(QUEUE_BUCKETS, wait)
        if i < len(QUEUE_BUCKETS):
            entry[0][i] += 1
        entry[1] += wait
        entry[2] += 1

    def queue_histograms(self) -> dict:
        """size -> (cumulative [(le, count)] ending with +Inf, sum): Prometheus' shape."""
        out = {}
        for size, (counts, total, n) in self.queue.items():
            acc, buckets = 0, []
            for le, c in zip(QUEUE_BUCKETS, counts, strict=True):
                acc += c
                buckets.append((str(le), acc))
            buckets.append(("+Inf", n))
            out[size] = (buckets, total)
        return out
