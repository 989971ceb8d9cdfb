"""The limits a request must keep, each written once: the protocol and the engine call these.

What it is for: the rules on values that more than one layer enforces -- token ids inside the
vocabulary, prompt + max_tokens inside the context, the logprobs cap, min_tokens against
max_tokens, logit_bias entries, stop strings -- and the caps on what one request may ask for.
`protocol/parse.py` calls them with the model's `EngineLimits` (a 400 before anything is queued),
`SamplingParams.__post_init__` with no model (vocab_size=None: ids only need to be >= 0), and
`Engine._validate` through `check_request` against its own limits, for callers that skip the
protocol (tests, benchmarks, generate()).
What it is not: the request models' shapes (pydantic, protocol/requests.py), prompt forms
(protocol/prompts.py), or anything about HTTP.

Every check raises InvalidRequest (ContextTooLong for the context), a ValueError too, whose
`param` names the field and position: "prompt[1][7]", "logit_bias.5", "stop[2]"; the first
problem only, except logit_bias, whose every bad entry is named ("logit_bias.5, logit_bias.x").
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken.errors import ContextTooLong, InvalidRequest

# Caps on what one request may ask for (each refusal is a 400 that names its cap). They keep one
# request from monopolising the event loop (validation is Python) or the response size.
MAX_N = 128  # choices per prompt
MAX_STOP = 32  # stop strings
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_MESSAGES = 1024  # chat messages
MAX_LOGPROB_TOKEN_IDS = 256  # logprob_token_ids entries (returned at every position)
MAX_BIAS = 100.0  # |logit_bias value|


def is_int(x: Any) -> bool:
    """An int that is not a bool (JSON's true is never a token id)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _vocabulary(vocab_size: int | None) -> str:
    return f"(0..{vocab_size - 1})" if vocab_size is not None else "(ids are >= 0)"


def _in_vocabulary(t: int, vocab_size: int | None) -> bool:
    return 0 <= t and (vocab_size is None or t < vocab_size)


def check_token_ids(
    ids: Sequence[Any], vocab_size: int | None, where: str, *, max_len: int | None = None
) -> None:
    """Every id an int in [0, vocab_size); the first that is not is named as "where[i]"."""
    if max_len is not None and len(ids) > max_len:
        raise InvalidRequest(
            f"{where} holds {len(ids)} token ids, more than the maximum of {max_len}", param=where
        )
    # NOTE: every prompt id passes here twice (protocol, engine), on the event loop: the common
    # case is decided by C-level passes, the loop below only names the first bad id.
    hi = vocab_size if vocab_size is not None else math.inf
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < hi:
        return
    for i, t in enumerate(ids):
        if not is_int(t):
            raise InvalidRequest(f"{where}[{i}] is not an integer token id", param=f"{where}[{i}]")
        if not _in_vocabulary(t, vocab_size):
            raise InvalidRequest(
                f"{where}[{i}] = {t} is outside the vocabulary {_vocabulary(vocab_size)}",
                param=f"{where}[{i}]",
            )


def check_prompt_not_empty(ids: Sequence[Any], where: str) -> None:
    if not ids:
        raise InvalidRequest(f"{where}: an empty token-id array cannot be evaluated", param=where)


def check_context(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, where: str | None = None
) -> None:
    """Prompt plus max_tokens must fit the context; `where` prefixes the message ("prompt[1]")."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextTooLong(
            f"{where + ': ' if where else ''}You passed {num_prompt_tokens} input tokens and "
            f"requested {max_tokens} output tokens; the context is {max_model_len}",
            param="max_tokens",
        )


def check_logprobs(value: Any, cap: int | None, name: str) -> None:
    """A top-K count (`logprobs`, `top_logprobs`, `prompt_logprobs`): None, or 0..cap."""
    if value is None:
        return
    if not is_int(value) or value < 0:
        raise InvalidRequest(f"{name} must be an integer >= 0, got {value!r}", param=name)
    if cap is not None and value > cap:
        raise InvalidRequest(
            f"Requested {name} of {value}, which is greater than max allowed: {cap}", param=name
        )


def check_logprob_token_ids(
    ids: Sequence[Any] | None,
    logprobs: int | None,
    vocab_size: int | None,
    *,
    max_len: int | None = None,
    requires: str = "logprobs to be set",
) -> None:
    """None, or a non-empty id list sent with logprobs (`logprobs` None: not asked for; the
    chat endpoint's rule reads "logprobs to be true")."""
    if ids is None:
        return
    if not ids:  # as vLLM: an empty list is refused before anything else
        raise InvalidRequest("logprob_token_ids must not be empty", param="logprob_token_ids")
    if logprobs is None:
        raise InvalidRequest(f"logprob_token_ids requires {requires}", param="logprob_token_ids")
    check_token_ids(ids, vocab_size, "logprob_token_ids", max_len=max_len)


def check_allowed_token_ids(ids: Sequence[Any] | None, vocab_size: int | None) -> None:
    if ids is None:
        return
    if not ids:
        raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
    check_token_ids(ids, vocab_size, "allowed_token_ids", max_len=vocab_size)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({min_tokens}) is greater than max_tokens ({max_tokens})",
            param="min_tokens",
        )


def logit_bias_ids(
    bias: Mapping[Any, Any] | None, vocab_size: int | None, *, max_len: int | None = None
) -> dict[int, float]:
    """{token id, or its decimal text (JSON keys are strings): bias in [-100, 100]} ->
    {id: float}, zeros kept.

    Every bad entry is named in one InvalidRequest (as vLLM lists every out-of-vocabulary id):
    one entry reads "logit_bias.5 = 200 is outside [-100, 100]" with param "logit_bias.5";
    several join their messages with "; " and their params with ", "."""
    if not bias:
        return {}
    if max_len is not None and len(bias) > max_len:
        raise InvalidRequest(
            f"logit_bias holds {len(bias)} entries, more than {max_len}", param="logit_bias"
        )
    out: dict[int, float] = {}
    bad: list[tuple[str, str]] = []  # (param, message)
    for key, value in bias.items():
        param = f"logit_bias.{key}"
        if is_int(key):
            tid = key
        else:
            k = key.strip() if isinstance(key, str) else ""
            if not (k.isdecimal() or (k.startswith("-") and k[1:].isdecimal())):
                shown = repr(key) if len(str(key)) <= 40 else repr(str(key)[:40]) + "..."
                bad.append((param, f"{param}: the key {shown} is not a token id"))
                continue
            tid = int(k)
        if not _in_vocabulary(tid, vocab_size):
            bad.append(
                (
                    param,
                    f"{param}: token id {tid} is outside the vocabulary {_vocabulary(vocab_size)}",
                )
            )
        elif not is_number(value):
            bad.append((param, f"{param} must be a number, got {value!r}"))
        elif not -MAX_BIAS <= value <= MAX_BIAS:
            bad.append((param, f"{param} = {value} is outside [-100, 100]"))
        else:
            out[tid] = float(value)
    if bad:
        raise InvalidRequest("; ".join(m for _, m in bad), param=", ".join(p for p, _ in bad))
    return out


def stop_list(stop: Any, *, max_len: int | None = None, max_chars: int | None = None) -> list[str]:
    """`stop` (None, a string, or a list of non-empty strings) -> a list of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequest("stop must be a string or an array of strings", param="stop")
    if max_len is not None and len(stop) > max_len:
        raise InvalidRequest(f"stop holds {len(stop)} strings, more than {max_len}", param="stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise InvalidRequest(f"stop[{i}] is not a string", param=f"stop[{i}]")
        if not s:
            raise InvalidRequest(f"stop[{i}] is an empty string", param=f"stop[{i}]")
        if max_chars is not None and len(s) > max_chars:
            raise InvalidRequest(
                f"stop[{i}] is {len(s)} characters long, more than {max_chars}",
                param=f"stop[{i}]",
            )
    return list(stop)


def _f32(x: float) -> float:
    """x as the engine's float32 sees it (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def check_float32(name: str, value: float | None, *, positive: bool = False) -> None:
    """NOTE: the engine samples in float32; a value that overflows, or a `positive` one that
    underflows to 0, would fail the whole engine step (every request in the batch)."""
    if value is None:
        return
    as32 = _f32(value)
    if math.isinf(as32) or (positive and value > 0 and as32 == 0):
        raise InvalidRequest(f"{name} = {value} is not representable in float32", param=name)


def check_request(prompt_ids: Sequence[Any], params, limits) -> None:
    """What the engine checks before it queues a request (Engine._validate): the prompt and
    every token id `params` names against `limits` (an EngineLimits), the logprobs cap."""
    vocab_size = limits.vocab_size
    check_prompt_not_empty(prompt_ids, "prompt")
    check_context(len(prompt_ids), params.max_tokens, limits.max_model_len)
    check_token_ids(prompt_ids, vocab_size, "prompt")
    check_logprobs(params.logprobs, limits.max_logprobs, "logprobs")
    check_logprobs(params.prompt_logprobs, limits.max_logprobs, "prompt_logprobs")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(params.allowed_token_ids or [], vocab_size, "allowed_token_ids")
    check_token_ids(params.logprob_token_ids or [], vocab_size, "logprob_token_ids")
    logit_bias_ids(params.logit_bias, vocab_size)
