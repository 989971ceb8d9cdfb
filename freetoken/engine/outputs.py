"""What a request gets back from the engine: RequestOutput deltas and the stream that carries them.

The engine thread posts one RequestOutput per step that touched a request (Sequence.take_output
builds it); the last one has finished=True. RequestStream carries them to the event loop;
merge_outputs folds them into one whole answer (Engine.generate). Not here: deciding what a delta
holds (sequence.py) or how the HTTP edge renders it (responses.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int                                                      # 1 = the most likely
    top: list[tuple[int, float]] = field(default_factory=list)     # top-K, best first
    extra: list[tuple[int, float]] = field(default_factory=list)   # logprob_token_ids entries
    # with allowed_token_ids: log of the mass the full distribution (after logit_bias) puts on
    # the allowed set, <= 0; None without a set, at prompt positions, or when not finite
    allowed_mass: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None        # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first delta only: [None, ...]
    finished: bool = False
    finish_reason: str | None = None                  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None              # the stop id or string that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0                        # prompt tokens served by the prefix cache
    num_output_tokens: int = 0
    error: str | None = None


class RequestStream:
    """Async iterator of one request's RequestOutput deltas; the last has finished=True."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False

    def _post(self, out: RequestOutput) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._done = True
        return out


def merge_outputs(deltas: Seq[RequestOutput]) -> RequestOutput:
    """One RequestOutput holding a whole request (what generate() returns)."""
    last = deltas[-1]
    out = RequestOutput(last.request_id, finished=last.finished, finish_reason=last.finish_reason,
                        stop_reason=last.stop_reason, num_prompt_tokens=last.num_prompt_tokens,
                        num_cached_tokens=last.num_cached_tokens,
                        num_output_tokens=last.num_output_tokens, error=last.error)
    lps: list[TokenLogprob] = []
    for d in deltas:
        out.new_token_ids += d.new_token_ids
        out.new_text += d.new_text
        if d.logprobs is not None:
            lps += d.logprobs
            out.logprobs = lps
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = d.prompt_logprobs
    return out
