"""The engine: one thread that owns every torch object and runs the step loop.

The asyncio side only calls submit() / abort() (thread-safe: one inbox message each) and reads
each request's RequestStream, which the engine thread feeds with loop.call_soon_threadsafe.
generate() is the synchronous twin, for tests and benchmarks.

Step: scheduler.schedule() -> runner.execute() -> scheduler.update() (which decides "finished"
through Sequence.append_token, frees KV) -> one delta per touched sequence to its sink.

NOTE: torch objects are touched only on the engine thread. Nothing in the step loop assumes CPU:
tensors are created on the KV pool's device (the model's), and results reach the host only as
token ids and logprob lists.

Not here: who runs this step (scheduler.py), the tensors (runner.py), what a request gets back
(outputs.py), the client-facing validation (protocol).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from freetoken.config import EngineConfig
from freetoken.engine.batch import KVCache
from freetoken.engine.kv_cache import BlockPool
from freetoken.engine.outputs import RequestOutput, RequestStream, merge_outputs
from freetoken.engine.runner import Runner
from freetoken.engine.sampler import Sampler
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.sequence import Sequence
from freetoken.errors import EngineDead, InvalidRequest, Overloaded
from freetoken.protocol import limits

logger = logging.getLogger("freetoken.engine")

# The wait for replacements after a step that finished requests is at most this share of the
# step, so the streams still running lose at most that much per finish (see _await_arrivals).
REPLACEMENT_WAIT_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class EngineLimits:
    vocab_size: int       # valid token ids are [0, vocab_size)
    max_model_len: int    # prompt + max_tokens must fit
    max_logprobs: int
    logits_width: int = 0  # columns of the lm_head (>= vocab_size when padded)


class Engine:
    def __init__(self, config: EngineConfig, loaded):
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = list(loaded.eos_token_ids)
        mc = loaded.config
        bs = config.block_size
        bytes_per_block = KVCache.bytes_per_block(mc.num_layers, bs, mc.num_kv_heads,
                                                  mc.head_dim, mc.hidden_size, self.model.dtype)
        self.num_blocks = config.resolve_num_blocks(bytes_per_block)
        model_len = mc.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"{model_len}")
        max_model_len = config.max_model_len or model_len
        if max_model_len > self.num_blocks * bs:
            # NOTE: a lone sequence must always fit the pool, or preemption could not guarantee
            # progress; so the context is capped to the pool instead of failing later.
            logger.warning("max_model_len %d capped to the KV pool: %d blocks x %d = %d tokens",
                           max_model_len, self.num_blocks, bs, self.num_blocks * bs)
            max_model_len = self.num_blocks * bs
        self.max_model_len = max_model_len
        logits_width = self.model.logits_width
        self.limits = EngineLimits(vocab_size=min(mc.vocab_size, logits_width),
                                   max_model_len=max_model_len,
                                   max_logprobs=config.max_logprobs, logits_width=logits_width)
        self.kv = self.model.make_kv_cache(self.num_blocks, bs)
        self.pool = BlockPool(self.num_blocks, bs, config.enable_prefix_cache,
                              fingerprint=loaded.fingerprint)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_model_len, self.eos_token_ids,
                                   enable_partial_reuse=config.enable_partial_block_reuse,
                                   policy=config.pressure_policy())
        self.runner = Runner(self.model, self.kv, Sampler(self.model.device), self.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None
        self._arrivals = 0
        # replacements awaited for the requests the last step finished (see _await_arrivals)
        self._expected, self._expected_until, self._arrived = 0, 0.0, 0
        self.totals = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                       "requests_finished_total": 0, "steps_total": 0, "step_errors_total": 0}
        self.finish_reasons: dict[str, int] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            try:
                from freetoken import ops
                backend = ops.backend()
            except Exception as exc:  # noqa: BLE001 - only for the log line
                backend = f"unavailable ({exc})"
            logger.info("engine: %d KV blocks x %d tokens, max_model_len %d, prefix cache %s, "
                        "ops backend %s, device %s", self.num_blocks, self.config.block_size,
                        self.max_model_len, "on" if self.config.enable_prefix_cache else "off",
                        backend, self.kv.hidden.device)
            self._thread = threading.Thread(target=self._loop, name="freetoken-engine",
                                            daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._dead is None
                and not self._stopping)

    # -- the asyncio side -------------------------------------------------------------------
    def submit(self, prompt_ids: Seq[int], params: SamplingParams,
               request_id: str | None = None, fork_from: str | None = None) -> RequestStream:
        """Queue one request; returns its stream. Call from the event loop (or any thread that
        runs one). Raises InvalidRequest / ContextTooLong / Overloaded / EngineDead.
        fork_from: the id of a request submitted earlier whose prompt is a prefix of this one's:
        its KV for those tokens is shared, never recomputed (scheduler.py, forks)."""
        loop = asyncio.get_running_loop()
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(rid, loop)
        self.add_request(prompt_ids, params, rid, stream._post, fork_from)
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: finish the request with "abort" and free its KV."""
        self._inbox.put(("abort", request_id))

    def pause(self, request_id: str, paused: bool) -> None:
        """Backpressure: stop scheduling the request (its KV is the first to be preempted), or
        carry on. Unknown or finished ids are no-ops."""
        self._inbox.put(("pause", (request_id, paused)))

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str,
                    sink: Callable[[RequestOutput], None], fork_from: str | None = None) -> None:
        """Thread-safe: validate and queue; `sink` is called on the engine thread per delta."""
        if not self.is_alive():
            why = f": {self._dead}" if self._dead else ""
            raise EngineDead(f"The engine loop is not running{why}.")
        prompt_ids = self._validate(prompt_ids, params)
        with self._lock:
            if request_id in self._live:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            waiting = len(self._live) - len(self.scheduler.running)
            if waiting >= self.config.max_queue_len:
                raise Overloaded()
            self._live.add(request_id)
            self._arrivals += 1
            arrival = self._arrivals
        detok = None
        if self.tokenizer is not None:
            from freetoken.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seq = Sequence(request_id, prompt_ids, params, seed, sink, detok, arrival)
        self._inbox.put(("add", (seq, fork_from)))

    def _validate(self, prompt_ids: Seq[int], params: SamplingParams) -> list[int]:
        ids = list(prompt_ids)
        limits.check_request(ids, params, self.limits)
        return ids

    # -- sync API ---------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 timeout_s: float | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all in flight at once); one merged output per prompt."""
        self.start()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        deltas: list[list[RequestOutput]] = [[] for _ in prompts]
        remaining = [len(prompts)]
        done = threading.Event()

        def sink_for(i):
            def sink(out: RequestOutput):
                deltas[i].append(out)
                if out.finished:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()
            return sink

        if not prompts:
            return []
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(p, sp, f"gen-{uuid.uuid4().hex[:12]}-{i}", sink_for(i))
        if not done.wait(timeout_s):
            raise TimeoutError("generate() timed out")
        return [merge_outputs(d) for d in deltas]

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler
        num_running = len(s.running)
        return {
            "num_running": num_running,
            "num_waiting": max(0, len(self._live) - num_running),
            "kv_blocks_used": self.pool.num_used_blocks,
            "kv_blocks_total": self.pool.num_blocks,
            "prefix_queries": self.pool.num_query_tokens,
            "prefix_hits": self.pool.num_hit_tokens,
            "num_preemptions": s.num_preemptions,
            "preemptions_by_cause": dict(s.stats.preemptions),
            "num_paused": s.num_paused,
            "queue_time": s.stats.queue_histograms(),
            **self.totals,
            "finish_reasons": dict(self.finish_reasons),
        }

    # -- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            self._dead = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            raise

    def _run(self) -> None:
        while not self._stopping:
            idle = not self.scheduler.has_work()
            self._drain_inbox(block=idle)
            if self._stopping:
                break
            if not self.scheduler.has_work():
                continue
            self._await_arrivals(cold=idle)
            self._step()
        for seq in self.scheduler.abort_all("abort"):
            self._post(seq)
        self._drain_inbox(block=False, reject=True)

    def _await_arrivals(self, cold: bool) -> None:
        """Before a step, wait a moment for requests that are about to arrive, so they share it.

        NOTE: a client with N requests in flight sends its next ones right after a step returns
        its answers, a few ms apart (4-30 ms for 8 here, HTTP and the client share the 2 cores).
        Starting the step at the first arrival splits them, and with prefill-heavy steps the
        split never heals: the latecomers run alone, their successors arrive during that step
        and miss the next one (measured at 8 in flight, classify: steps alternating 6 and 2
        sequences, ~30 % of the throughput lost). So:
          * after a step that finished F requests, the engine waits for up to F arrivals (their
            replacements), at most arrival_window_ms from the step's end and never longer than
            REPLACEMENT_WAIT_FRACTION of that step, so running streams lose at most that once per
            finish;
          * a cold idle engine (nothing finished lately) that just got a request keeps admitting
            while requests arrive within arrival_gap_ms of each other, at most arrival_window_ms;
            a lone request pays one gap.
        arrival_window_ms = 0 turns both off."""
        if self.config.arrival_window_ms <= 0:
            return
        now = time.monotonic()
        expected, self._expected = self._expected, 0
        if expected and now < self._expected_until:
            deadline, gap_s = self._expected_until, None
        elif cold:
            deadline, gap_s = now + self.config.arrival_window_ms / 1e3, \
                self.config.arrival_gap_ms / 1e3
        else:
            return
        s = self.scheduler
        while len(s.waiting) + len(s.running) < self.config.max_num_seqs:
            if gap_s is None and self._arrived >= expected:
                return
            timeout = deadline - now if gap_s is None else min(gap_s, deadline - now)
            if timeout <= 0:
                return
            try:
                msg = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return
            self._handle(msg, reject=False)
            self._drain_inbox(block=False)
            now = time.monotonic()

    def _drain_inbox(self, block: bool, reject: bool = False) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg, reject)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple, reject: bool) -> None:
        kind, obj = msg
        if kind == "add":
            seq, fork_from = obj
            if reject:
                seq.finish("abort")
                self._post(seq)
            else:
                self.totals["prompt_tokens_total"] += seq.num_prompt_tokens
                self.scheduler.add(seq, fork_from)
                self._arrived += 1
        elif kind == "abort":
            seq = self.scheduler.abort(obj)
            if seq is not None:
                self._post(seq)
        elif kind == "pause":
            self.scheduler.set_paused(*obj)

    def _step(self) -> None:
        """One step. NOTE: an exception fails only the sequences of this step (finish_reason
        "error", KV freed); the waiting ones and the loop carry on. A failure in schedule()
        itself is a bug in the scheduler's state: everything in flight is failed then."""
        try:
            out = self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001
            logger.exception("schedule() failed; failing every request in flight")
            self.totals["step_errors_total"] += 1
            for seq in self.scheduler.abort_all("error", f"{type(exc).__name__}: {exc}"):
                self._post(seq)
            return
        if not out.scheduled:
            time.sleep(0.001)  # NOTE: unreachable while a lone sequence always fits the pool
            return
        started = time.monotonic()
        try:
            try:
                results = self.runner.execute(out)
            finally:
                self.scheduler.release_pins(out)
            posts = self.scheduler.update(out, results)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            logger.exception("engine step failed; failing its %d requests", len(out.scheduled))
            self.totals["step_errors_total"] += 1
            seqs = [item.seq for item in out.scheduled]
            self.scheduler.fail(seqs, f"{type(exc).__name__}: {exc}")
            for seq in seqs:  # failed now, or finished by update() before it raised
                if seq.is_finished:
                    self._post(seq)
            return
        self.totals["steps_total"] += 1
        for seq in posts:
            self._post(seq)
        finished = sum(seq.is_finished for seq in posts)
        if finished:
            now = time.monotonic()
            wait_s = min(self.config.arrival_window_ms / 1e3,
                         (now - started) * REPLACEMENT_WAIT_FRACTION)
            self._expected, self._expected_until, self._arrived = finished, now + wait_s, 0

    def _post(self, seq: Sequence) -> None:
        delta = seq.take_output()
        self.totals["generation_tokens_total"] += len(delta.new_token_ids)
        if delta.finished:
            self.totals["requests_finished_total"] += 1
            reason = delta.finish_reason or "unknown"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            with self._lock:
                self._live.discard(seq.request_id)
        try:
            seq.sink(delta)
        except Exception:  # noqa: BLE001 - a broken sink must not kill the loop
            logger.exception("output sink of %s failed", seq.request_id)

