"""The wire protocol: request models, every refusal of SPEC.md, (responses live in responses.py).

What it is for: turning a JSON body into prompt id lists plus `SamplingParams` (or an
`InvalidRequest` whose `param` names the field and position), and turning engine `RequestOutput`
deltas into OpenAI-shaped dicts (responses.py). Pure functions and plain data: no I/O, no engine,
no HTTP.
What it is not: the HTTP edge (server.py renders errors and streams bytes).

Two validation layers (docs/architecture.md section 5): pydantic v2 models, strict (a bool or a
float is never an int), `extra="forbid"`; then checks against the model (`EngineLimits`: vocab
size, context length, logprobs cap) in `parse_completion` / `parse_chat`.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from freetoken.errors import ContextTooLong, InvalidRequest
from freetoken.sampling_params import SamplingParams

MAX_N = 128
MAX_STOP = 32
# Limits on what one request may ask for (each refusal is a 400 that names its limit). They keep
# one request from monopolising the event loop (validation is Python) or the response size.
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_MESSAGES = 1024  # chat messages
MAX_LOGPROB_TOKEN_IDS = 256  # logprob_token_ids entries (returned at every position)

_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer"}}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": _TOKEN_IDS_SCHEMA},
    ]
}
_STOP_SCHEMA = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]
}
_CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
        {"type": "null"},
    ]
}


def _schema_any(schema: dict, description: str | None = None):
    return Annotated[Any, WithJsonSchema(schema), Field(description=description)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: Literal[False] | None = False


# ------------------------------------------------------------------------------------------
# Request models. Fields marked "neutral only" are accepted with their neutral value (common
# clients send defaults) and refused with "X is not supported" otherwise; see _UNSUPPORTED.
# ------------------------------------------------------------------------------------------


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: the whole vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - MAX_N, description="int64; choice j of n uses seed + j"
    )
    n: int = Field(1, ge=1, le=MAX_N)
    stop: _schema_any(_STOP_SCHEMA) = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # neutral only
    best_of: int | None = Field(None, description="neutral only: null or 1")
    use_beam_search: bool | None = Field(None, description="neutral only: false")
    length_penalty: float | None = Field(None, description="neutral only: 1.0")
    response_format: dict | None = Field(None, description='neutral only: {"type": "text"}')
    structured_outputs: Any = Field(None, description="neutral only: null")
    guided_json: Any = Field(None, description="neutral only: null")
    guided_regex: Any = Field(None, description="neutral only: null")
    guided_choice: Any = Field(None, description="neutral only: null")
    guided_grammar: Any = Field(None, description="neutral only: null")
    guided_decoding_backend: Any = Field(None, description="neutral only: null")
    guided_whitespace_pattern: Any = Field(None, description="neutral only: null")
    truncate_prompt_tokens: int | None = Field(None, description="neutral only: null")
    bad_words: list[str] | None = Field(None, description="neutral only: null or []")
    logits_processors: Any = Field(None, description="neutral only: null or []")
    spaces_between_special_tokens: bool | None = Field(None, description="neutral only: true")
    priority: int | None = Field(None, description="neutral only: 0")
    cache_salt: Any = Field(None, description="neutral only: null")
    return_token_ids: bool | None = Field(None, description="neutral only: false")
    # vllm-router (and SGLang's router) re-serialize every request with these defaults
    no_stop_trim: bool | None = Field(None, description="neutral only: false")
    return_hidden_states: bool | None = Field(None, description="neutral only: false")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (SPEC.md)."""

    prompt: _schema_any(_PROMPT_SCHEMA, "str, list[str], list[int] or list[list[int]]")
    max_tokens: int | None = Field(16, ge=0, description="default 16; 0 only with echo")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = True
    suffix: str | None = Field(None, description="neutral only: null or empty")
    prompt_embeds: Any = Field(None, description="neutral only: null")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: _schema_any(_CONTENT_SCHEMA) = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions (SPEC.md)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool | None = Field(None, description="neutral only: false")
    chat_template: str | None = Field(None, description="neutral only: null")
    chat_template_kwargs: dict | None = Field(None, description="neutral only: null or {}")
    tools: list | None = Field(None, description="neutral only: null or []")
    tool_choice: Any = Field(None, description='neutral only: null or "none"')
    parallel_tool_calls: bool | None = None
    documents: Any = Field(None, description="neutral only: null")
    # vllm-router's defaults (FreeToken has no reasoning parser: true changes nothing)
    separate_reasoning: bool | None = Field(None, description="neutral only: true")
    stream_reasoning: bool | None = Field(None, description="neutral only: true")
    include_reasoning: bool | None = Field(None, description="neutral only: true")


class TokenizeRequest(_Strict):
    """POST /tokenize: either `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


_UNSUPPORTED: dict[str, tuple] = {
    # field: neutral values
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "truncate_prompt_tokens": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "spaces_between_special_tokens": (None, True),
    "priority": (None, 0),
    "cache_salt": (None,),
    "return_token_ids": (None, False),
    "suffix": (None, ""),
    "prompt_embeds": (None,),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "documents": (None,),
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    "separate_reasoning": (None, True),
    "stream_reasoning": (None, True),
    "include_reasoning": (None, True),
}
# Sampling fields whose neutral value is accepted even if SamplingParams lacks them.
_NEUTRAL_SAMPLING = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
}
_SP_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


# ------------------------------------------------------------------------------------------
# Validation helpers
# ------------------------------------------------------------------------------------------


def loc_to_param(loc: Sequence[Any]) -> str:
    """("prompt", 1, 7) -> "prompt[1][7]"; ("logit_bias", "5") -> "logit_bias.5"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validate_model(cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body against `cls`; the first error becomes an InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = loc_to_param(err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {param}", param=param
            ) from None
        if err["type"] == "missing":
            raise InvalidRequest(f"{param} is required", param=param) from None
        raise InvalidRequest(f"{param}: {err['msg']}", param=param) from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ids(ids: list[int], vocab_size: int, where: str, max_len: int | None = None) -> None:
    if max_len is not None and len(ids) > max_len:
        raise InvalidRequest(
            f"{where} holds {len(ids)} token ids, more than the maximum of {max_len}", param=where
        )
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise InvalidRequest(f"{where}[{i}] is not an integer token id", param=f"{where}[{i}]")
        if not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"{where}[{i}] = {t} is outside the vocabulary (0..{vocab_size - 1})",
                param=f"{where}[{i}]",
            )


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    text: str | None  # the request's text, for text prompts


def normalize_prompt(
    raw: Any,
    *,
    vocab_size: int,
    tokenizer,
    add_special_tokens: bool,
    max_batch_prompts: int,
    context: tuple[int, int] | None = None,
) -> list[Prompt]:
    """The four prompt forms of SPEC.md -> a list of Prompt. Ids are used exactly.

    `context` = (max_tokens, max_model_len): an id prompt too long for it is refused before its
    ids are checked one by one (a huge array costs no per-element Python work)."""
    bad_type = InvalidRequest("prompt must be a string or an array of token ids", param="prompt")

    def encode(text: str, where: str) -> Prompt:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest(
                f"{where}: the text yields no tokens and cannot be evaluated", param=where
            )
        for i, t in enumerate(ids):  # an added token beyond the model's vocabulary
            if not 0 <= t < vocab_size:
                raise InvalidRequest(
                    f"{where}: the text tokenizes to id {t} at position {i}, outside the "
                    f"vocabulary (0..{vocab_size - 1})",
                    param=where,
                )
        return Prompt(list(ids), text)

    def id_list(ids: list, where: str) -> Prompt:
        if not ids:
            raise InvalidRequest(
                f"{where}: an empty token-id array cannot be evaluated", param=where
            )
        if context is not None and len(ids) + context[0] > context[1]:
            _check_context([Prompt(ids, None)], context[0], context[1], where)
        _check_ids(ids, vocab_size, where)
        return Prompt(list(ids), None)

    if isinstance(raw, str):
        prompts = [encode(raw, "prompt")]
    elif isinstance(raw, list):
        if not raw or not isinstance(raw[0], (str, list)):
            prompts = [id_list(raw, "prompt")]
        elif isinstance(raw[0], str):
            for i, p in enumerate(raw):
                if not isinstance(p, str):
                    raise InvalidRequest(
                        f"prompt[{i}] is not a string (a list of text prompts must hold only "
                        f"strings)",
                        param=f"prompt[{i}]",
                    )
            prompts = None
        else:
            for i, p in enumerate(raw):
                if not isinstance(p, list):
                    raise InvalidRequest(
                        f"prompt[{i}] is not an array of token ids (a batch of id prompts must "
                        f"hold only arrays)",
                        param=f"prompt[{i}]",
                    )
            prompts = None
        if prompts is None:
            if len(raw) > max_batch_prompts:
                raise InvalidRequest(
                    f"prompt holds {len(raw)} prompts, more than the maximum of "
                    f"{max_batch_prompts} (--max-batch-prompts)",
                    param="prompt",
                )
            if isinstance(raw[0], str):
                prompts = [encode(p, f"prompt[{i}]") for i, p in enumerate(raw)]
            else:
                prompts = [id_list(p, f"prompt[{i}]") for i, p in enumerate(raw)]
    else:
        raise bad_type
    return prompts


def _check_unsupported(req: BaseModel) -> None:
    for name in req.model_fields_set:
        neutral = _UNSUPPORTED.get(name)
        if neutral is not None and getattr(req, name) not in neutral:
            raise InvalidRequest(f"{name} is not supported", param=name)
    for name, neutral in _NEUTRAL_SAMPLING.items():
        value = getattr(req, name, None)
        if name not in _SP_FIELDS and value is not None and value != neutral:
            raise InvalidRequest(f"{name} is not supported", param=name)


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise InvalidRequest("stop must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise InvalidRequest(f"stop holds {len(stop)} strings, more than {MAX_STOP}", param="stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise InvalidRequest(f"stop[{i}] is not a string", param=f"stop[{i}]")
        if not s:
            raise InvalidRequest(f"stop[{i}] is an empty string", param=f"stop[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"stop[{i}] is {len(s)} characters long, more than {MAX_STOP_CHARS}",
                param=f"stop[{i}]",
            )
    return list(stop)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias holds {len(bias)} entries, more than {MAX_LOGIT_BIAS}", param="logit_bias"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        param = f"logit_bias.{key}"
        k = key.strip()
        if not (k.isdigit() or (k.startswith("-") and k[1:].isdigit())):
            shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."
            raise InvalidRequest(f"{param}: the key {shown} is not a token id", param=param)
        tid = int(k)
        if not 0 <= tid < vocab_size:
            raise InvalidRequest(
                f"{param}: token id {tid} is outside the vocabulary (0..{vocab_size - 1})",
                param=param,
            )
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest(f"{param} = {value} is outside [-100, 100]", param=param)
        out[tid] = float(value)
    return out


def _check_logprobs_cap(value: int | None, cap: int, param: str) -> None:
    if value is not None and value > cap:
        raise InvalidRequest(
            f"Requested {param} of {value}, which is greater than max allowed: {cap}", param=param
        )


def _f32(x: float) -> float:
    """x as the engine's float32 sees it (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def _check_float32(req: _SamplingFields) -> None:
    # NOTE: the engine samples in float32; a value that overflows, or a positive one that
    # underflows to 0, would fail the whole engine step (every request in the batch).
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(req, name, None)
        if value is None:
            continue
        as32 = _f32(value)
        if math.isinf(as32) or (
            value > 0 and as32 == 0 and name in ("top_p", "repetition_penalty")
        ):
            raise InvalidRequest(f"{name} = {value} is not representable in float32", param=name)


def _sampling_kwargs(req: _SamplingFields, vocab_size: int) -> dict[str, Any]:
    _check_unsupported(req)
    _check_float32(req)
    kw: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k in (None, 0) else req.top_k,
        "seed": req.seed,
        "stop": _stop_list(req.stop),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "min_tokens": req.min_tokens,
    }
    if req.min_p is not None:
        kw["min_p"] = req.min_p
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.stop_token_ids:
        _check_ids(req.stop_token_ids, vocab_size, "stop_token_ids", max_len=vocab_size)
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
        _check_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids", max_len=vocab_size)
        kw["allowed_token_ids"] = list(dict.fromkeys(req.allowed_token_ids))
    bias = _logit_bias(req.logit_bias, vocab_size)
    if bias:
        kw["logit_bias"] = bias
    return kw  # NOTE: no filtering: a field SamplingParams lacks must fail loudly, never vanish


def _check_context(
    prompts: list[Prompt], max_tokens: int, max_model_len: int, name: str | None = None
) -> None:
    for i, p in enumerate(prompts):
        if len(p.ids) + max_tokens > max_model_len:
            if name is not None:
                where = "" if name == "prompt" else f"{name}: "
            else:
                where = f"prompt[{i}]: " if len(prompts) > 1 else ""
            raise ContextTooLong(
                f"{where}You passed {len(p.ids)} input tokens and requested {max_tokens} output "
                f"tokens; the context is {max_model_len}",
                param="max_tokens",
            )


def _make_params(kw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
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


def parse_completion(body: Any, limits, tokenizer, *, max_batch_prompts: int = 64) -> ParsedRequest:
    req: CompletionRequest = validate_model(CompletionRequest, body)
    cap = limits.max_logprobs
    _check_logprobs_cap(req.logprobs, cap, "logprobs")
    _check_logprobs_cap(req.prompt_logprobs, cap, "prompt_logprobs")
    if req.logprob_token_ids is not None:
        if req.logprobs is None:
            raise InvalidRequest(
                "logprob_token_ids requires logprobs to be set", param="logprob_token_ids"
            )
        _check_ids(
            req.logprob_token_ids,
            limits.vocab_size,
            "logprob_token_ids",
            max_len=MAX_LOGPROB_TOKEN_IDS,
        )
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise InvalidRequest(
            "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens"
        )
    if req.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({req.min_tokens}) is greater than max_tokens ({max_tokens})",
            param="min_tokens",
        )
    kw = _sampling_kwargs(req, limits.vocab_size)
    prompts = normalize_prompt(
        req.prompt,
        vocab_size=limits.vocab_size,
        tokenizer=tokenizer,
        add_special_tokens=req.add_special_tokens,
        max_batch_prompts=max_batch_prompts,
        context=(max_tokens, limits.max_model_len),
    )
    _check_context(prompts, max_tokens, limits.max_model_len)
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
    so = req.stream_options
    return ParsedRequest(
        request=req,
        prompts=prompts,
        params=_make_params(kw),
        n=req.n,
        echo=req.echo,
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        score_only=score_only,
        stream=req.stream,
        include_usage=bool(req.stream and so and so.include_usage),
        model=req.model,
    )


def _message_text(msg: ChatMessage, i: int) -> str:
    c = msg.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise InvalidRequest(
            f"messages[{i}].content must be a string or an array of text parts",
            param=f"messages[{i}].content",
        )
    texts = []
    for j, part in enumerate(c):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(
                f"{where}: content part of type {kind!r} is not supported (only text)", param=where
            )
        extra = set(part) - {"type", "text"}
        if extra:
            name = sorted(extra)[0]
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {where}.{name}", param=f"{where}.{name}"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(
    messages: list[ChatMessage], tokenizer, *, add_generation_prompt: bool, add_special_tokens: bool
) -> tuple[str, list[int]]:
    """Messages -> (template text, prompt ids). BOS only as the template renders it."""
    plain = [
        {"role": m.role, "content": _message_text(m, i)} | ({"name": m.name} if m.name else {})
        for i, m in enumerate(messages)
    ]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except InvalidRequest as exc:  # chat_template.ChatTemplateError: the template refused them
        if exc.param is None:
            exc.param = "messages"
        raise
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise InvalidRequest("messages: the conversation yields no tokens", param="messages")
    return text, ids


def parse_chat(body: Any, limits, tokenizer) -> ParsedRequest:
    req: ChatCompletionRequest = validate_model(ChatCompletionRequest, body)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    _check_logprobs_cap(req.top_logprobs, limits.max_logprobs, "top_logprobs")
    kw = _sampling_kwargs(req, limits.vocab_size)
    text, ids = render_chat(
        req.messages,
        tokenizer,
        add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=req.add_special_tokens,
    )
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:  # an added token beyond the model's vocabulary
            raise InvalidRequest(
                f"messages: the rendered prompt holds token id {t} at "
                f"position {i}, outside the vocabulary",
                param="messages",
            )
    prompts = [Prompt(ids, text)]
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = limits.max_model_len - len(ids)
        if max_tokens < 1:
            _check_context(prompts, 1, limits.max_model_len)
    else:
        _check_context(prompts, max_tokens, limits.max_model_len)
    if req.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({req.min_tokens}) is greater than max_tokens ({max_tokens})",
            param="min_tokens",
        )
    kw["max_tokens"] = max_tokens
    lp = None
    if req.logprobs:
        lp = req.top_logprobs or 0
        kw["logprobs"] = lp
    so = req.stream_options
    return ParsedRequest(
        request=req,
        prompts=prompts,
        params=_make_params(kw),
        n=req.n,
        logprobs=lp,
        stream=req.stream,
        include_usage=bool(req.stream and so and so.include_usage),
        model=req.model,
    )


def parse_tokenize(body: Any, limits, tokenizer) -> dict:
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
    return {"tokens": ids, "count": len(ids), "max_model_len": limits.max_model_len}


def parse_detokenize(body: Any, limits) -> list[int]:
    req: DetokenizeRequest = validate_model(DetokenizeRequest, body)
    _check_ids(req.tokens, limits.vocab_size, "tokens")
    return list(req.tokens)
