"""Response and SSE chunk builders: engine `RequestOutput` deltas -> OpenAI-shaped dicts.

A ChoiceState turns one engine stream into fragments; streaming sends each fragment as a chunk,
non-streaming merges them -- so both modes produce the same text and logprobs. Pure functions and
plain data: no I/O, no engine, no HTTP. Requests are parsed in protocol/parse.py.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken.protocol.parse import ParsedRequest
    from freetoken.protocol.prompts import Prompt


# JSON has no infinities: a -inf logprob (an id outside allowed_token_ids asked for through
# logprob_token_ids, or a -inf logit) is rendered as OpenAI's and vLLM's stand-in
MIN_LOGPROB = -9999.0


def logprob_value(lp: float) -> float:
    return max(float(lp), MIN_LOGPROB)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def token_key(tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else token_text(tokenizer, token_id)


def _top_dict(tokenizer, tl, k: int, as_ids: bool) -> dict[str, float]:
    """Top k plus the sampled token plus the logprob_token_ids entries, best first.

    NOTE: without return_tokens_as_token_ids two ids can decode to the same text; the dict keeps
    the higher logprob of the two. With token_id:N keys nothing collides.
    """
    entries = [*list(tl.top)[:k], (tl.token_id, tl.logprob), *(getattr(tl, "extra", None) or [])]
    entries.sort(key=lambda e: -float(e[1]))  # stable: ties keep the engine's order
    out: dict[str, float] = {}
    for tid, lp in entries:
        out.setdefault(token_key(tokenizer, tid, as_ids), logprob_value(lp))
    return out


def _char_offsets(tokenizer, ids: Sequence[int], start: int, end: int) -> list[int]:
    """Character offset of each token in text[start:end]: complete chars before its bytes."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, pos = [], start
    for tid in ids:
        offsets.append(min(pos, end))
        pos += len(dec.decode(tokenizer.token_bytes(tid)))
    return offsets


@dataclass
class LegacyLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    # FreeToken's extension, only with allowed_token_ids: per position, the log of the mass the
    # full distribution puts on the allowed set (null at prompt positions); None: key absent
    allowed_logprobs: list[float | None] | None = None

    def extend(self, other: LegacyLogprobs) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset
        if other.allowed_logprobs is not None:
            self.allowed_logprobs = (self.allowed_logprobs or []) + other.allowed_logprobs

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.allowed_logprobs is None:
            del out["allowed_logprobs"]
        return out


@dataclass
class Fragment:
    """One choice's increment: what a chunk carries, and what a full response concatenates."""

    text: str = ""
    logprobs: LegacyLogprobs | list[dict] | None = None
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def prompt_logprobs_entries(tokenizer, prompt_ids: list[int], plps: list, k: int) -> list:
    """vLLM's prompt_logprobs: [None, {"<id>": {logprob, rank, decoded_token}}, ...]."""
    out: list = []
    for pos, tl in enumerate(plps):
        if tl is None:
            out.append(None)
            continue
        entry = {}
        for rank, (tid, lp) in enumerate(list(tl.top)[:k], start=1):
            entry[str(tid)] = {
                "logprob": logprob_value(lp),
                "rank": rank,
                "decoded_token": token_text(tokenizer, tid),
            }
        entry.setdefault(
            str(tl.token_id),
            {
                "logprob": logprob_value(tl.logprob),
                "rank": int(tl.rank),
                "decoded_token": token_text(tokenizer, tl.token_id),
            },
        )
        out.append(entry)
    return out


class ChoiceState:
    """Turns the RequestOutput deltas of one engine request into Fragments (completions API)."""

    def __init__(self, tokenizer, parsed: ParsedRequest, prompt: Prompt):
        self.tok = tokenizer
        self.parsed = parsed
        self.prompt = prompt
        self.as_ids = bool(parsed.request.return_tokens_as_token_ids)
        self.with_mass = parsed.params.allowed_token_ids is not None  # allowed_logprob(s)
        self.text_len = 0
        self.first = True
        self.num_prompt_tokens = len(prompt.ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    def _gen_logprobs(self, out, start: int) -> LegacyLogprobs:
        k = self.parsed.logprobs or 0
        lps = out.logprobs or []
        ids = [tl.token_id for tl in lps]
        res = LegacyLogprobs(
            tokens=[token_key(self.tok, t, self.as_ids) for t in ids],
            token_logprobs=[logprob_value(tl.logprob) for tl in lps],
            top_logprobs=[_top_dict(self.tok, tl, k, self.as_ids) for tl in lps],
            text_offset=_char_offsets(self.tok, ids, start, self.text_len),
        )
        if self.with_mass:
            res.allowed_logprobs = [tl.allowed_mass for tl in lps]
        return res

    def feed(self, out) -> Fragment:
        frag = Fragment()
        start = self.text_len
        self.num_cached_tokens = int(out.num_cached_tokens or 0)  # fixed at first admission
        if self.first:
            self.first = False
            if self.parsed.echo:
                ptext = self.tok.decode(self.prompt.ids, skip_special_tokens=False)
                frag.text += ptext
                self.text_len += len(ptext)
                if self.parsed.logprobs is not None:
                    frag.logprobs = self._echo_logprobs(out.prompt_logprobs, ptext)
                start = self.text_len
            if self.parsed.prompt_logprobs is not None and out.prompt_logprobs is not None:
                frag.prompt_logprobs = prompt_logprobs_entries(
                    self.tok, self.prompt.ids, out.prompt_logprobs, self.parsed.prompt_logprobs
                )
        if self.parsed.score_only:
            if out.finished:
                frag.finish_reason = "length"
                self.finish_reason = "length"
            return frag
        new_text = out.new_text or ""
        frag.text += new_text
        self.text_len += len(new_text)
        self.num_output_tokens += len(out.new_token_ids or [])
        if self.parsed.logprobs is not None and out.logprobs:
            gen = self._gen_logprobs(out, start)
            if frag.logprobs is None:
                frag.logprobs = gen
            else:
                frag.logprobs.extend(gen)
        if out.finished:
            self.finish_reason = out.finish_reason
            frag.finish_reason = out.finish_reason
            frag.stop_reason = getattr(out, "stop_reason", None)
        return frag

    def _echo_logprobs(self, plps: list | None, ptext: str) -> LegacyLogprobs:
        ids = self.prompt.ids
        k = self.parsed.logprobs or 0
        plps = list(plps or [None] * len(ids))
        res = LegacyLogprobs(
            tokens=[token_key(self.tok, t, self.as_ids) for t in ids],
            token_logprobs=[None if tl is None else logprob_value(tl.logprob) for tl in plps],
            top_logprobs=[
                None if tl is None else _top_dict(self.tok, tl, k, self.as_ids) for tl in plps
            ],
            text_offset=_char_offsets(self.tok, ids, 0, len(ptext)),
        )
        if self.with_mass:  # the prompt is scored, not sampled from the set
            res.allowed_logprobs = [None] * len(ids)
        return res


def merge_fragments(frags: list[Fragment]) -> Fragment:
    total = Fragment()
    for f in frags:
        total.text += f.text
        if f.logprobs is not None:
            if total.logprobs is None:
                total.logprobs = (
                    type(f.logprobs)() if isinstance(f.logprobs, LegacyLogprobs) else []
                )
            if isinstance(f.logprobs, LegacyLogprobs):
                total.logprobs.extend(f.logprobs)
            else:
                total.logprobs += f.logprobs
        if f.prompt_logprobs is not None:
            total.prompt_logprobs = f.prompt_logprobs
        if f.finish_reason is not None:
            total.finish_reason = f.finish_reason
            total.stop_reason = f.stop_reason
    return total


class ChatChoiceState(ChoiceState):
    """The chat API: logprobs as content[] = {token, logprob, bytes, top_logprobs}."""

    def _entry(self, tid: int, lp: float) -> dict:
        return {
            "token": token_key(self.tok, tid, self.as_ids),
            "logprob": logprob_value(lp),
            "bytes": list(self.tok.token_bytes(tid)),
        }

    def _content(self, tl, k: int) -> dict:
        """One content[] entry: top_logprobs holds the top k plus the logprob_token_ids entries
        (each id once, best first); allowed_logprob only with allowed_token_ids."""
        top = dict(list(tl.top)[:k])
        for t, lp in getattr(tl, "extra", None) or []:
            top.setdefault(t, lp)
        ranked = sorted(top.items(), key=lambda e: -float(e[1]))  # stable: ties keep the order
        entry = self._entry(tl.token_id, tl.logprob)
        entry["top_logprobs"] = [self._entry(t, lp) for t, lp in ranked]
        if self.with_mass:
            entry["allowed_logprob"] = tl.allowed_mass
        return entry

    def feed(self, out) -> Fragment:
        frag = Fragment()
        self.first = False
        self.num_cached_tokens = int(out.num_cached_tokens or 0)
        frag.text = out.new_text or ""
        self.num_output_tokens += len(out.new_token_ids or [])
        if self.parsed.logprobs is not None and out.logprobs:
            k = self.parsed.logprobs
            frag.logprobs = [self._content(tl, k) for tl in out.logprobs]
        if out.finished:
            self.finish_reason = out.finish_reason
            frag.finish_reason = out.finish_reason
            frag.stop_reason = getattr(out, "stop_reason", None)
        return frag


def usage_dict(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_choice(index: int, frag: Fragment) -> dict:
    choice = {
        "index": index,
        "text": frag.text,
        "logprobs": frag.logprobs.to_dict()
        if isinstance(frag.logprobs, LegacyLogprobs)
        else frag.logprobs,
        "finish_reason": frag.finish_reason,
        "stop_reason": frag.stop_reason,
    }
    if frag.prompt_logprobs is not None:
        choice["prompt_logprobs"] = frag.prompt_logprobs
    return choice


def completion_response(
    request_id: str, model: str, choices: list[dict], usage: dict, created: int | None = None
) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def completion_chunk(request_id: str, model: str, created: int, index: int, frag: Fragment) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [completion_choice(index, frag)],
    }


def chat_choice(index: int, frag: Fragment) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": frag.text},
        "logprobs": None if frag.logprobs is None else {"content": frag.logprobs},
        "finish_reason": frag.finish_reason,
        "stop_reason": frag.stop_reason,
    }


def chat_response(
    request_id: str, model: str, choices: list[dict], usage: dict, created: int | None = None
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_chunk(
    request_id: str, model: str, created: int, index: int, frag: Fragment, first: bool = False
) -> dict:
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if frag.text or first:
        delta["content"] = frag.text
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if frag.logprobs is None else {"content": frag.logprobs},
                "finish_reason": frag.finish_reason,
                "stop_reason": frag.stop_reason,
            }
        ],
    }


def usage_chunk(request_id: str, model: str, created: int, obj: str, usage: dict) -> dict:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
    }
