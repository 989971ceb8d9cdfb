"""One request inside the engine: its token ids, its KV blocks, its output state.

`Sequence.append_token` is the one place that decides "finished" (EOS unless ignore_eos,
stop_token_ids, stop strings, max_tokens, min_tokens, the context end). `take_output` turns what
happened since the last call into a RequestOutput delta (outputs.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

from freetoken.engine.kv_cache import ChainCursor
from freetoken.engine.outputs import RequestOutput, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, seed: int,
                 sink: Callable[[RequestOutput], None], detokenizer=None, arrival: int = 0):
        self.request_id = request_id
        self.params = params
        self.seed = seed                       # params.seed, or a random one drawn at submit
        self.sink = sink                       # called on the engine thread with each delta
        self.detokenizer = detokenizer         # IncrementalDetokenizer or None (ids only)
        self.arrival = arrival
        self.priority = params.priority
        self.queued_at = time.monotonic()      # for the queue-time histogram
        self.paused = False                    # its stream's client stopped reading
        self.order = 0                         # the scheduler's arrival count (ties of priority)
        self.token_ids: list[int] = list(prompt_ids)   # prompt + output
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        # KV state (reset on preemption)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []      # hashes of the leading full blocks (kept)
        self.cursor = ChainCursor()
        self.num_cached_tokens = 0             # of the first admission: what usage reports
        self.num_preemptions = 0
        self.admitted = False
        # fork: (parent, n) -- at admission this sequence shares the parent's KV of its first n
        # tokens (the same ids) instead of computing them; the parent keeps its blocks until
        # its num_fork_children have been admitted (scheduler.py)
        self.fork: tuple[Sequence, int] | None = None
        self.num_fork_children = 0
        # prompt logprobs: entry p-1 holds position p's logprob (position 0 has none); positions
        # before params.prompt_logprobs_start are None and never computed
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            self._unscored_positions() if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = params.prompt_logprobs is None
        # output state since the last delta
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.text = ""                         # output text so far (stop strings cut)
        self.num_text_sent = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    # -- lengths ----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return not self.prompt_logprobs_sent

    @property
    def num_prompt_logprobs_done(self) -> int:
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    def reset_kv(self) -> None:
        """Preempted: blocks are gone; everything is recomputed (mostly from the prefix cache)."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.cursor = ChainCursor()
        if not self.prompt_logprobs_sent and self.prompt_logprobs is not None:
            self.prompt_logprobs = self._unscored_positions()

    def _unscored_positions(self) -> list[None]:
        skip = min(self.params.prompt_logprobs_start, self.num_prompt_tokens) - 1
        return [None] * max(0, skip)

    # -- finishing: the one place ---------------------------------------------------------------
    def finish(self, reason: str, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        if self.detokenizer is not None and not isinstance(stop_reason, str) \
                and not self.is_finished:
            self.text += self.detokenizer.flush()  # a held-back partial character, as U+FFFD
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def check_prefill_only(self) -> bool:
        """max_tokens=0 (echo scoring): finished once the prompt is computed."""
        if self.params.max_tokens == 0 and self.num_computed_tokens >= self.num_tokens:
            self.finish("length")
            return True
        return False

    def append_token(self, token_id: int, logprob: TokenLogprob | None,
                     eos_token_ids: Seq[int], max_model_len: int) -> bool:
        """Add one sampled token and decide whether the sequence is finished."""
        p = self.params
        self.token_ids.append(token_id)
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        n = self.num_output_tokens
        may_stop = n >= p.min_tokens
        if may_stop and not p.ignore_eos and token_id in eos_token_ids:
            self.finish("stop")
            return True
        if may_stop and token_id in p.stop_token_ids:
            self.finish("stop", token_id)
            return True
        if self.detokenizer is not None:
            new = self.detokenizer.push([token_id])
            if new:
                start = len(self.text)
                self.text += new
                if p.stop and may_stop and self._check_stop_strings(start):
                    return True
        if n >= p.max_tokens:
            self.finish("length")
            return True
        if self.num_tokens >= max_model_len:
            self.finish("length")
            return True
        return False

    def _check_stop_strings(self, new_start: int) -> bool:
        window = max(0, new_start - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, window)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s)] if self.params.include_stop_str_in_output \
            else self.text[:i]
        self.num_text_sent = min(self.num_text_sent, len(self.text))
        self.finish("stop", s)
        return True

    # -- deltas -------------------------------------------------------------------------------
    def take_output(self) -> RequestOutput:
        """What happened since the last delta. Text that could still turn into a stop string is
        held back (vLLM's stop buffer) until it cannot, or the sequence ends."""
        hold = 0
        if not self.is_finished and self.params.stop and not self.params.include_stop_str_in_output:
            hold = self.max_stop_len - 1
        end = max(self.num_text_sent, len(self.text) - hold)
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.pending_ids,
            new_text=self.text[self.num_text_sent:end],
            logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            error=self.error,
        )
        self.num_text_sent = end
        if not self.prompt_logprobs_sent and self.prompt_logprobs is not None and \
                (len(self.prompt_logprobs) >= self.num_prompt_tokens - 1 or self.is_finished):
            out.prompt_logprobs = [None, *self.prompt_logprobs]
            self.prompt_logprobs_sent = True
            self.prompt_logprobs = None
        self.pending_ids = []
        self.pending_logprobs = []
        return out
