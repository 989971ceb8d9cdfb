"""The scheduler: which sequences compute how many tokens this step, and what follows from it.

schedule() decides (plain data out: SchedulerOutput); the runner does; update() applies the
runner's results (append tokens, index full blocks, decide finished, free KV).

Policy, decided once:
  * Running sequences first, best first ((priority, arrival); pressure.py): decodes (1 token)
    and the next chunk of a chunked prefill share the per-step token budget
    (max_num_batched_tokens). Then waiting sequences are admitted in that order while budget,
    max_num_seqs and free blocks allow; a prefill larger than the remaining budget is chunked.
    Paused sequences (their stream's client stopped reading) are skipped and hold no seat. A
    waiting sequence whose next full block is being computed by a running prefill steps aside
    (it keeps its place) until that block is indexed, so prompts that arrive together and
    share a prefix compute it once.
  * Admission, two calls to the pool: find_cached_prefix (capped at len-1 tokens) -- full
    blocks, then a partial block (the donor's first m slots are copied into the sequence's fresh
    block by the runner, the donor pinned for the step) -- then admit, which takes those and
    blocks for the scheduled chunk only (KVCacheBlocks). When the head of the queue does not
    fit, admission is held (no skipping ahead, so no starvation) until blocks free up; only
    short work may pass it, and with `policy.projected` a long sequence is admitted only while
    the running set's projected KV peak fits (pressure.py).
  * Pool full while growing a running sequence: preempt a paused sequence, else the worst
    running one (lowest priority, newest: the least work lost; free its blocks, reset it to
    WAITING in its place in the queue) and retry; recompute later, mostly from the prefix
    cache, as its full blocks stay indexed. The oldest sequence always makes progress, and
    Engine.submit refuses sequences longer than the pool, so a lone sequence always fits: no
    deadlock, no dropped request. Only short work is admitted in a step that preempted.
  * Short work (pressure.py) that finds no seat or no blocks preempts a paused sequence, else
    the worst running one if it is long and of no better priority; a better priority may
    preempt a worse one (vLLM's priority policy). Nothing admitted in this step is taken back.
  * Forks (scoring: a query shared by items, an item shared by labels): a sequence added with
    `fork_from` shares its parent's KV of the parent's prompt -- the full blocks by reference,
    the partial last block copied as a partial prefix hit is -- whether or not the prefix cache
    is on, so the shared tokens are computed once and never again. It waits (keeping its
    place) until the parent has computed them. A parent that finishes while children still
    wait is *held*: its blocks stay until the last child is admitted. Held blocks are the first
    thing given up under pressure (before any preemption, or when nothing runs); a child whose
    parent's blocks are gone computes from the prefix cache instead, with the same result.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from freetoken.engine.kv_cache import BlockPool, CachedPrefix
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.pressure import PressurePolicy, PressureStats, admits_long, displacement
from freetoken.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int             # num_computed_tokens before this step
    num_new_tokens: int    # tokens start:start+num_new_tokens are computed this step
    sample: bool           # the chunk reaches the end: sample the next token
    # prompt logprobs: logits rows needed at positions [pl_start, pl_end); those below `start`
    # are cached positions (their hidden state is read from KVCache.hidden)
    pl_start: int = 0
    pl_end: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence] = field(default_factory=list)
    # partial-block hits: copy the first m slots of block src into block dst before the forward
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)  # donors, referenced until release_pins

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class StepResult:
    """What the runner produced for one scheduled sequence."""
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for [pl_start, pl_end)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Seq[int] = (),
                 enable_partial_reuse: bool = False, policy: PressurePolicy | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_partial_reuse = enable_partial_reuse
        self.policy = policy or PressurePolicy()
        # both kept in (priority, arrival) order
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # finished parents whose blocks wait for their forks
        self.num_preemptions = 0
        self.num_added = 0
        self.stats = PressureStats()

    # -- queue ------------------------------------------------------------------------------
    def add(self, seq: Sequence, fork_from: str | None = None) -> None:
        """Queue a sequence; with `fork_from` (the id of a live sequence whose prompt is a
        prefix of this one's), it will share that sequence's KV. An unknown id, or a prompt that
        does not extend the parent's, queues it as a plain sequence."""
        seq.status = SequenceStatus.WAITING
        if fork_from is not None:
            parent = next((s for s in (*self.running, *self.waiting, *self.held)
                           if s.request_id == fork_from), None)
            n = parent.num_prompt_tokens if parent is not None else 0
            if parent is not None and n < seq.num_tokens and \
                    seq.token_ids[:n] == parent.token_ids[:n]:
                seq.fork = (parent, n)
                parent.num_fork_children += 1
        self.num_added += 1
        seq.order = self.num_added
        insort(self.waiting, seq, key=_key)

    def has_work(self) -> bool:
        """Whether a step could compute anything (paused sequences wait for their client)."""
        return any(not s.paused for s in self.running) or any(not s.paused for s in self.waiting)

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Pause (its stream's client stopped reading) or resume a live sequence."""
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                seq.paused = paused
                return True
        return False

    @property
    def num_paused(self) -> int:
        return sum(s.paused for s in (*self.running, *self.waiting))

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.running):
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._release(seq)
                seq.finish("abort")
                return seq
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._drop_fork(seq)
                seq.finish("abort")
                return seq
        return None

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[Sequence]:
        out = []
        for seq in self.running + list(self.waiting):
            self._release(seq)
            seq.finish(reason, error=error)
            out.append(seq)
        self.running.clear()
        self.waiting.clear()
        self._release_held()
        return out

    def fail(self, seqs: Seq[Sequence], error: str) -> list[Sequence]:
        """Finish these sequences with "error" and free their KV (a step failed on them)."""
        out = []
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
                self._drop_fork(seq)
            self._release(seq)
            seq.finish("error", error=error)
            out.append(seq)
        return out

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []

    def _release_held(self) -> None:
        """Give up every held parent's blocks (their waiting forks will compute instead)."""
        for parent in self.held:
            self._release(parent)
        self.held.clear()

    def _drop_fork(self, seq: Sequence) -> None:
        """The child no longer waits on its parent (admitted, or gone): a held parent with no
        child left waiting gives its blocks back."""
        if seq.fork is None:
            return
        parent = seq.fork[0]
        seq.fork = None
        parent.num_fork_children -= 1
        if parent.num_fork_children == 0 and parent in self.held:
            self.held.remove(parent)
            self._release(parent)

    def _fork_state(self, seq: Sequence) -> str:
        """"ready" (the parent's KV of the shared tokens is there), "wait" (the parent has yet
        to compute it) or "gone" (the parent finished and gave its blocks back)."""
        parent, n = seq.fork
        if parent.block_table and parent.num_computed_tokens >= n:
            return "ready"
        return "gone" if parent.is_finished else "wait"

    def _fork_prefix(self, seq: Sequence, cached: CachedPrefix) -> CachedPrefix:
        """The prefix a ready fork is admitted with: the shared full blocks (the cache's own
        hit when it holds them all, so the sequence's chain stays indexable; else the parent's
        blocks, and its own blocks are never indexed), then the parent's partial block lent
        as a partial hit."""
        parent, n = seq.fork
        full, m = divmod(n, self.block_size)
        if len(cached.block_ids) >= full:
            blocks = cached.block_ids[:full]
        else:
            blocks = parent.block_table[:full]
            seq.cursor.broken = True
        donor = (parent.block_table[full], m) if m else None
        return CachedPrefix(blocks, n, donor)

    # -- deciding ---------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _make(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + n
        sample = end == seq.num_tokens and seq.params.max_tokens > 0
        item = ScheduledSeq(seq, start, n, sample)
        if seq.wants_prompt_logprobs:
            # logits at position q give the logprob of prompt token q+1
            item.pl_start = seq.num_prompt_logprobs_done
            item.pl_end = min(end, seq.num_prompt_tokens - 1)
            if item.pl_end < item.pl_start:
                item.pl_end = item.pl_start
        return item

    def _inflight_hashes(self) -> set[int]:
        """Hashes of the full prompt blocks that running prefills have yet to compute."""
        out: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                out.update(seq.block_hashes[seq.num_computed_tokens // self.block_size:])
        return out

    def _preempt(self, seq: Sequence, cause: str, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.reset_kv()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.stats.preempted(cause)
        insort(self.waiting, seq, key=_key)
        out.preempted.append(seq)

    def _growth_victim(self) -> tuple[Sequence, str]:
        """Who gives way when a running sequence needs blocks: a paused one, else the worst."""
        paused = [s for s in self.running if s.paused]
        return (paused[-1], "paused") if paused else (self.running[-1], "kv")

    def _displace(self, seq: Sequence, fresh: set[int], out: SchedulerOutput,
                  seat: bool) -> bool:
        """Make room for a waiting sequence that finds no seat (`seat`) or no blocks: preempt a
        paused sequence (for blocks: it holds no seat), else the worst running one when `seq`
        outranks it (a better priority, or short work against long work of no better priority).
        True when something was preempted. Sequences admitted this step (`fresh`, by id) are
        never taken back."""
        old = [s for s in self.running if id(s) not in fresh]
        paused = [s for s in old if s.paused]
        if paused and not seat:
            self._preempt(paused[-1], "paused", out)
            return True
        old = [s for s in old if not s.paused]
        if not old:
            return False
        victim = old[-1]
        cause = displacement(self.policy, seq, victim, None if seat else self.pool)
        if cause is None:
            return False
        self._unschedule(victim, out)
        self._preempt(victim, cause, out)
        return True

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> None:
        out.scheduled = [item for item in out.scheduled if item.seq is not seq]

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([])
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.paused:
                continue
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted from the end: everything after it is gone too
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, n)
            while not self.pool.can_allocate(need):
                if self.held:  # idle blocks go before anyone's work
                    self._release_held()
                    continue
                victim, cause = self._growth_victim()
                self._preempt(victim, cause, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            seq.block_table += self.pool.allocate(need)
            out.scheduled.append(self._make(seq, n))
            budget -= n
        self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order. When one does not fit (blocks, seats, or the
        projection), admission is held: only short work may pass it (policy.short_max_tokens);
        with none, nothing passes. After a growth preemption only short work is admitted."""
        p = self.policy
        plain = not (p.projected or p.long_headroom(self.pool.num_blocks))
        inflight = self._inflight_hashes() if self.pool.enable_prefix_cache else set()
        fresh: set[int] = set()  # admitted this step (by id): never displaced
        held = bool(out.preempted)
        i = skipped = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            short = p.is_short(seq)
            if seq.paused or (held and not short) or seq in out.preempted:
                i += 1  # a sequence preempted in this step is not taken back in it
                continue
            if sum(not s.paused for s in self.running) >= self.max_num_seqs:
                if self._displace(seq, fresh, out, seat=True):
                    budget = self.max_num_batched_tokens - out.num_tokens
                    i = self.waiting.index(seq)  # the victim went back into the queue
                    continue
                if p.short_max_tokens < 0:
                    break
                held = True
                i += 1
                continue
            prefix = self.pool.find_cached_prefix(seq.token_ids, seq.block_hashes, seq.cursor,
                                                  partial=self.enable_partial_reuse)
            num_hits = len(prefix.block_ids)
            fork = None
            if seq.fork is not None and prefix.num_cached_tokens < seq.fork[1]:
                fork = self._fork_state(seq)
                if fork == "wait":
                    i += 1  # keeps its place; its parent is ahead of it or running
                    continue
                if fork == "ready":
                    prefix = self._fork_prefix(seq, prefix)
            if (fork != "ready" and num_hits < len(seq.block_hashes)
                    and seq.block_hashes[num_hits] in inflight and skipped < self.max_num_seqs):
                # NOTE: its next full block is being computed by a running prefill (or one
                # admitted just now): wait for it to be indexed rather than compute it twice.
                # This is how a batch of prompts sharing a prefix runs the prefix once.
                i += 1
                skipped += 1
                continue
            num_cached = prefix.num_cached_tokens
            n = min(seq.num_tokens - num_cached, budget)
            blocks = None
            if short or plain or admits_long(
                    p, seq, [s for s in self.running if not s.paused], self.pool,
                    -(-(num_cached + n) // self.block_size) - len(prefix.block_ids),
                    self.max_model_len):
                blocks = self.pool.admit(prefix, num_cached + n, seq.num_tokens)
                if blocks is None and (self._displace(seq, fresh, out, seat=False)
                                       or (not self.running and self.held)):
                    if self.held and not self.running:
                        self._release_held()  # nothing runs to free blocks: held ones must go
                    # and this sequence tries again (from the cache), with the budget given back
                    budget = self.max_num_batched_tokens - out.num_tokens
                    i = self.waiting.index(seq)
                    continue
            if blocks is None:
                if p.short_max_tokens < 0:
                    break  # hold admission until blocks free up
                held = True
                i += 1
                continue
            self._drop_fork(seq)
            if blocks.copy is not None:
                out.copies.append(blocks.copy)
                out.pinned.append(blocks.copy[0])
            seq.block_table = blocks.block_ids
            seq.num_computed_tokens = num_cached
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = num_cached
                self.stats.admitted(seq, short)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            insort(self.running, seq, key=_key)
            fresh.add(id(seq))
            inflight.update(seq.block_hashes[num_hits:])
            out.scheduled.append(self._make(seq, n))
            budget -= n

    def release_pins(self, out: SchedulerOutput) -> None:
        """After the runner copied the partial blocks (or failed): drop the donors' references."""
        if out.pinned:
            self.pool.free(out.pinned)
            out.pinned = []

    # -- applying ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, results: Seq[StepResult]) -> list[Sequence]:
        """Apply one step's results; returns the sequences that have a delta to post."""
        to_post: list[Sequence] = []
        for item, res in zip(out.scheduled, results, strict=True):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.pool.cache_blocks(seq.block_table, seq.token_ids, seq.block_hashes, seq.cursor,
                                   seq.num_computed_tokens)
            if res.prompt_logprobs and seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(res.prompt_logprobs)
            if item.sample:
                if res.token_id is None:
                    raise RuntimeError(f"runner returned no token for {seq.request_id}")
                seq.append_token(res.token_id, res.logprob, self.eos_token_ids,
                                 self.max_model_len)
                to_post.append(seq)
            elif seq.check_prefill_only():
                to_post.append(seq)
            if seq.is_finished:
                self.running.remove(seq)
                if seq.num_fork_children:
                    self.held.append(seq)  # its forks still wait to share its blocks
                else:
                    self._release(seq)
        return to_post


def _key(seq: Sequence) -> tuple[int, int]:
    """Scheduling order: lower priority value first (vLLM), then arrival."""
    return (seq.priority, seq.order)
