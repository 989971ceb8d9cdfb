"""Parsing a request: a JSON body -> prompt id lists plus `SamplingParams`, or an InvalidRequest.

What it is for: `parse_completion` / `parse_chat` / `parse_tokenize` / `parse_detokenize`, the
one entry per route. Two validation layers (docs/architecture.md): the strict pydantic models of
protocol/requests.py (shape), then the checks against the model (`EngineLimits`: vocabulary,
context length, logprobs cap) of protocol/limits.py, which the engine shares. The result is a
`ParsedRequest`: what the server needs to run prompts x n engine requests. Pure functions and
plain data: no I/O, no engine, no HTTP.
What it is not: the HTTP edge (which renders errors and streams bytes) or the response shapes
(protocol/responses.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from freetoken.engine.sampling_params import SamplingParams
from freetoken.errors import InvalidRequest
from freetoken.protocol import limits
from freetoken.protocol.prompts import Prompt, check_context, normalize_prompt, render_chat
from freetoken.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
    neutral_only_fields,
    validate_model,
)

_DEFAULT_MAX_TOKENS = CompletionRequest.model_fields["max_tokens"].default


def check_unsupported(req: BaseModel) -> None:
    """A NeutralOnly field sent with a value other than its neutral ones: a 400, "X is not
    supported" (the generation and scoring routes)."""
    sent = req.model_fields_set
    for name, neutral in neutral_only_fields(type(req)).items():  # in declaration order
        if name in sent and getattr(req, name) not in neutral:
            raise InvalidRequest(f"{name} is not supported", param=name)


def _sampling_kwargs(req: _SamplingFields, vocab_size: int) -> dict[str, Any]:
    check_unsupported(req)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        limits.check_float32(
            name, getattr(req, name), positive=name in ("top_p", "repetition_penalty")
        )
    kw: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k in (None, 0) else req.top_k,
        "seed": req.seed,
        "stop": limits.stop_list(
            req.stop, max_len=limits.MAX_STOP, max_chars=limits.MAX_STOP_CHARS
        ),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "min_tokens": req.min_tokens,
        "priority": req.priority or 0,
    }
    if req.min_p is not None:
        kw["min_p"] = req.min_p
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.stop_token_ids:
        limits.check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids", max_len=vocab_size)
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.allowed_token_ids is not None:
        limits.check_allowed_token_ids(req.allowed_token_ids, vocab_size)
        kw["allowed_token_ids"] = list(dict.fromkeys(req.allowed_token_ids))
    bias = limits.logit_bias_ids(req.logit_bias, vocab_size, max_len=limits.MAX_LOGIT_BIAS)
    if bias:
        kw["logit_bias"] = bias
    return kw  # NOTE: no filtering: a field SamplingParams lacks must fail loudly, never vanish


def _check_stream_options(req: _SamplingFields) -> None:
    # as OpenAI and vLLM: options for a stream that will not happen are a client's mistake
    # (stricter than vLLM, which lets an empty {} through: any value but null is refused)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def _make_params(kw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidRequest:  # a shared limit (protocol/limits.py): it names its field
        raise
    except ValueError as exc:  # an engine invariant our checks missed: still the client's input
        raise InvalidRequest(str(exc)) from None


@dataclass(slots=True)
class ParsedRequest:
    """What the server needs to run one request: prompts x n engine requests."""

    request: BaseModel
    prompts: list[Prompt]
    params: SamplingParams
    n: int
    # completions only
    echo: bool = False
    logprobs: int | None = None  # legacy top-K per position (None: no logprobs)
    prompt_logprobs: int | None = None  # the vLLM `prompt_logprobs` field
    score_only: bool = False  # max_tokens 0 + echo: the prompt is scored, nothing sampled
    stream: bool = False
    include_usage: bool = False
    model: str | None = None

    def choice_params(self, j: int) -> SamplingParams:
        """Choice j of a prompt: seed + j when a seed is set (n > 1 stays reproducible)."""
        if j == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + j)


def _parsed(req, prompts: list[Prompt], kw: dict[str, Any], **fields) -> ParsedRequest:
    """The ParsedRequest of a validated body: what every generation endpoint shares (params,
    n, stream, usage, model), plus the endpoint's own `fields`."""
    so = req.stream_options
    return ParsedRequest(request=req, prompts=prompts, params=_make_params(kw), n=req.n,
                         stream=req.stream, include_usage=bool(req.stream and so
                                                               and so.include_usage),
                         model=req.model, **fields)


def parse_completion(
    body: Any, engine_limits, tokenizer, *, max_batch_prompts: int
) -> ParsedRequest:
    """POST /v1/completions. `engine_limits`: the engine's EngineLimits."""
    req: CompletionRequest = validate_model(CompletionRequest, body)
    _check_stream_options(req)
    cap = engine_limits.max_logprobs
    limits.check_logprobs(req.logprobs, cap, "logprobs")
    limits.check_logprobs(req.prompt_logprobs, cap, "prompt_logprobs")
    limits.check_logprob_token_ids(
        req.logprob_token_ids,
        req.logprobs,
        engine_limits.vocab_size,
        max_len=limits.MAX_LOGPROB_TOKEN_IDS,
    )
    max_tokens = _DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise InvalidRequest(
            "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens"
        )
    limits.check_min_tokens(req.min_tokens, max_tokens)
    kw = _sampling_kwargs(req, engine_limits.vocab_size)
    prompts = normalize_prompt(
        req.prompt,
        vocab_size=engine_limits.vocab_size,
        tokenizer=tokenizer,
        add_special_tokens=req.add_special_tokens,
        max_batch_prompts=max_batch_prompts,
        context=(max_tokens, engine_limits.max_model_len),
    )
    check_context(prompts, max_tokens, engine_limits.max_model_len)
    score_only = max_tokens == 0
    kw["max_tokens"] = max_tokens  # 0: the engine finishes once the prompt is computed
    if req.logprobs is not None:
        kw["logprobs"] = req.logprobs
        if req.logprob_token_ids:
            kw["logprob_token_ids"] = list(dict.fromkeys(req.logprob_token_ids))
    internal_prompt_lp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        internal_prompt_lp = max(req.logprobs, req.prompt_logprobs or 0)
    if internal_prompt_lp is not None:
        kw["prompt_logprobs"] = internal_prompt_lp
    return _parsed(req, prompts, kw, echo=req.echo, logprobs=req.logprobs,
                   prompt_logprobs=req.prompt_logprobs, score_only=score_only)


def parse_chat(body: Any, engine_limits, tokenizer) -> ParsedRequest:
    """POST /v1/chat/completions. `engine_limits`: the engine's EngineLimits."""
    req: ChatCompletionRequest = validate_model(ChatCompletionRequest, body)
    _check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    limits.check_logprobs(req.top_logprobs, engine_limits.max_logprobs, "top_logprobs")
    limits.check_logprob_token_ids(
        req.logprob_token_ids,
        0 if req.logprobs else None,
        engine_limits.vocab_size,
        max_len=limits.MAX_LOGPROB_TOKEN_IDS,
        requires="logprobs to be true",
    )
    kw = _sampling_kwargs(req, engine_limits.vocab_size)
    text, ids = render_chat(
        req.messages,
        tokenizer,
        add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=req.add_special_tokens,
    )
    for i, t in enumerate(ids):
        if not 0 <= t < engine_limits.vocab_size:  # an added token beyond the model's vocabulary
            raise InvalidRequest(
                f"messages: the rendered prompt holds token id {t} at "
                f"position {i}, outside the vocabulary",
                param="messages",
            )
    prompts = [Prompt(ids, text)]
    max_model_len = engine_limits.max_model_len
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(ids)
        if max_tokens < 1:
            check_context(prompts, 1, max_model_len)
    else:
        check_context(prompts, max_tokens, max_model_len)
    limits.check_min_tokens(req.min_tokens, max_tokens)
    kw["max_tokens"] = max_tokens
    lp = None
    if req.logprobs:
        lp = req.top_logprobs or 0
        kw["logprobs"] = lp
        if req.logprob_token_ids:
            kw["logprob_token_ids"] = list(dict.fromkeys(req.logprob_token_ids))
    return _parsed(req, prompts, kw, logprobs=lp)


def parse_tokenize(body: Any, engine_limits, tokenizer) -> dict:
    """POST /tokenize -> its response body."""
    req: TokenizeRequest = validate_model(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("exactly one of prompt and messages is required", param="prompt")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=add))
    else:
        if not req.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        _, ids = render_chat(
            req.messages,
            tokenizer,
            add_generation_prompt=req.add_generation_prompt,
            add_special_tokens=bool(req.add_special_tokens),
        )
    return {"tokens": ids, "count": len(ids), "max_model_len": engine_limits.max_model_len}


def parse_detokenize(body: Any, engine_limits) -> list[int]:
    """POST /detokenize -> the ids to decode."""
    req: DetokenizeRequest = validate_model(DetokenizeRequest, body)
    limits.check_token_ids(req.tokens, engine_limits.vocab_size, "tokens")
    return list(req.tokens)
