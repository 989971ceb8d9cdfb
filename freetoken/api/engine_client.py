"""What the HTTP edge needs from the engine, written down as one Protocol.

`freetoken.engine.Engine` is the one implementation (tests/server/test_server.py checks it has every
member named here); tests that replace a method (a failing `submit`, a dead `is_alive`) replace it
with something of the same shape. The edge calls these members directly and nothing else of the
engine: if a route needs more, it is added here first.

What it is not: the engine's own interface (start, shutdown, generate and the step loop belong to
the CLI, tests and benchmarks, not to the edge).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from freetoken.engine import EngineLimits
    from freetoken.engine.sampling_params import SamplingParams
    from freetoken.sequence import RequestOutput
    from freetoken.tokenizer import Tokenizer


@runtime_checkable
class EngineSettings(Protocol):
    """The two settings of the engine's config that the edge reads."""

    @property
    def max_queue_len(self) -> int: ...  # a request's prompts x n must fit the queue

    @property
    def block_size(self) -> int: ...  # KV tokens per block: the load reports count tokens


@runtime_checkable
class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...  # parsing, /tokenize, /detokenize, choice text

    @property
    def limits(self) -> EngineLimits: ...  # the model-dependent request checks (protocol.py)

    @property
    def config(self) -> EngineSettings: ...

    def is_alive(self) -> bool:
        """False once the step loop died or the engine is stopping: /health answers 503 and
        every request in flight ends with one."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        fork_from: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue one engine request (from the event loop); its deltas, the last with
        finished=True. Raises a FreeTokenError (InvalidRequest, ContextTooLong, Overloaded,
        EngineDead) when it cannot be queued. fork_from: an earlier request whose prompt is a
        prefix of this one's; its KV for those tokens is shared (the scoring routes)."""
        ...

    def abort(self, request_id: str) -> None:
        """Finish the request with "abort" and free its KV; unknown or finished ids are no-ops."""
        ...

    def pause(self, request_id: str, paused: bool) -> None:
        """Backpressure on a stream: stop scheduling the request (paused) or resume it; unknown
        or finished ids are no-ops."""
        ...

    def stats(self) -> dict[str, Any]:
        """Live numbers for /metrics and the load reports: num_running, num_waiting,
        kv_blocks_used, kv_blocks_total, prefix_queries, prefix_hits, num_preemptions and the
        *_total counters, num_paused, preemptions_by_cause, queue_time."""
        ...
