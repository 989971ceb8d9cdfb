"""The request models: pydantic v2, strict, one per route, and which fields are neutral only.

What it is for: the shape of a request body -- required fields, JSON types (a bool or a float is
never an int), ranges, `extra="forbid"` (an unknown field is a 400, as OpenAI answers) -- and
`validate_model`, which turns pydantic's first error into an InvalidRequest naming the field.
Fields FreeToken does not implement are declared here with `NeutralOnly(values...)`: accepted at
one of their neutral values (common clients send their defaults), refused with "X is not
supported" otherwise; `neutral_only_fields(model)` reads them off the model.
What it is not: the checks against the model (protocol/limits.py) or turning a request into
prompt ids and SamplingParams (protocol/parse.py). The server builds /openapi.json from these.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from freetoken.errors import InvalidRequest
from freetoken.protocol.limits import MAX_MESSAGES, MAX_N

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


class NeutralOnly:
    """Field metadata: FreeToken does not implement the field; it accepts only `values` (the
    defaults common clients send) and refuses any other value with "<field> is not supported".
    Invisible to pydantic's validation and to the JSON schema (the description says it)."""

    __slots__ = ("values",)

    def __init__(self, *values: Any):
        self.values = values

    def __repr__(self) -> str:
        return f"NeutralOnly{self.values!r}"


@functools.cache
def neutral_only_fields(model: type[BaseModel]) -> dict[str, tuple]:
    """{field: its neutral values} for every field of `model` declared with NeutralOnly."""
    return {
        name: meta.values
        for name, info in model.model_fields.items()
        for meta in info.metadata
        if isinstance(meta, NeutralOnly)
    }


# ------------------------------------------------------------------------------------------
# Request models. Fields declared NeutralOnly(...) are accepted with a neutral value and
# refused with "X is not supported" otherwise (protocol/parse.py checks them).
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
    allowed_token_ids: list[int] | None = Field(
        None,
        description="sample only these ids; with logprobs, logprobs are renormalized over the "
        "set and each sampled position also reports the log of the mass the full distribution "
        "puts on the set (allowed_logprobs / allowed_logprob in the response)",
    )
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # neutral only
    best_of: Annotated[int | None, NeutralOnly(None, 1)] = Field(
        None, description="neutral only: null or 1"
    )
    use_beam_search: Annotated[bool | None, NeutralOnly(None, False)] = Field(
        None, description="neutral only: false"
    )
    length_penalty: Annotated[float | None, NeutralOnly(None, 1.0)] = Field(
        None, description="neutral only: 1.0"
    )
    response_format: Annotated[dict | None, NeutralOnly(None, {"type": "text"})] = Field(
        None, description='neutral only: {"type": "text"}'
    )
    structured_outputs: Annotated[Any, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    guided_json: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")
    guided_regex: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")
    guided_choice: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")
    guided_grammar: Annotated[Any, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    guided_decoding_backend: Annotated[Any, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    guided_whitespace_pattern: Annotated[Any, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    truncate_prompt_tokens: Annotated[int | None, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    bad_words: Annotated[list[str] | None, NeutralOnly(None, [])] = Field(
        None, description="neutral only: null or []"
    )
    logits_processors: Annotated[Any, NeutralOnly(None, [])] = Field(
        None, description="neutral only: null or []"
    )
    spaces_between_special_tokens: Annotated[bool | None, NeutralOnly(None, True)] = Field(
        None, description="neutral only: true"
    )
    priority: int | None = Field(
        None, description="vLLM's: lower is scheduled first (default 0); docs/api.md, Under load"
    )
    cache_salt: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")
    return_token_ids: Annotated[bool | None, NeutralOnly(None, False)] = Field(
        None, description="neutral only: false"
    )
    # vllm-router (and SGLang's router) re-serialize every request with these defaults
    no_stop_trim: Annotated[bool | None, NeutralOnly(None, False)] = Field(
        None, description="neutral only: false"
    )
    return_hidden_states: Annotated[bool | None, NeutralOnly(None, False)] = Field(
        None, description="neutral only: false"
    )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (SPEC.md)."""

    prompt: _schema_any(_PROMPT_SCHEMA, "str, list[str], list[int] or list[list[int]]")
    max_tokens: int | None = Field(16, ge=0, description="default 16; 0 only with echo")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    logprob_token_ids: list[int] | None = Field(
        None, description="non-empty; needs logprobs; these ids join top_logprobs at every position"
    )
    prompt_logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = True
    suffix: Annotated[str | None, NeutralOnly(None, "")] = Field(
        None, description="neutral only: null or empty"
    )
    prompt_embeds: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")


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
    logprob_token_ids: list[int] | None = Field(
        None, description="non-empty; needs logprobs: true; these ids join top_logprobs"
    )
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: Annotated[bool | None, NeutralOnly(None, False)] = Field(
        None, description="neutral only: false"
    )
    chat_template: Annotated[str | None, NeutralOnly(None)] = Field(
        None, description="neutral only: null"
    )
    chat_template_kwargs: Annotated[dict | None, NeutralOnly(None, {})] = Field(
        None, description="neutral only: null or {}"
    )
    tools: Annotated[list | None, NeutralOnly(None, [])] = Field(
        None, description="neutral only: null or []"
    )
    tool_choice: Annotated[Any, NeutralOnly(None, "none")] = Field(
        None, description='neutral only: null or "none"'
    )
    parallel_tool_calls: bool | None = None
    documents: Annotated[Any, NeutralOnly(None)] = Field(None, description="neutral only: null")
    # vllm-router's defaults (FreeToken has no reasoning parser: true changes nothing)
    separate_reasoning: Annotated[bool | None, NeutralOnly(None, True)] = Field(
        None, description="neutral only: true"
    )
    stream_reasoning: Annotated[bool | None, NeutralOnly(None, True)] = Field(
        None, description="neutral only: true"
    )
    include_reasoning: Annotated[bool | None, NeutralOnly(None, True)] = Field(
        None, description="neutral only: true"
    )


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
