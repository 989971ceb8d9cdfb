"""Chat templates rendered as transformers renders them, in jinja2's immutable sandbox.

Same environment as transformers' `apply_chat_template`: `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` tag,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, and dunder-proof
`namespace`/`dict`. Variables: `messages`, `add_generation_prompt`, `tools`, `documents`,
`bos_token`, `eos_token` (+ any extra keyword the caller passes, e.g. `enable_thinking`).

The rendered text already holds every special token the template writes, BOS included: encode it
with `add_special_tokens=False`, or the prompt starts with two BOS (as transformers' own
`apply_chat_template(tokenize=True)` does).

Not here: which template a model has (tokenizer/) and the request's message validation
(freetoken.protocol).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken.errors import FreeTokenError, InvalidRequest


class ChatTemplateError(InvalidRequest):
    """The conversation cannot be rendered: the template refused it (`raise_exception`, e.g.
    "roles must alternate"), failed on it, or the model has no chat template. A 400."""

    def __init__(self, message: str):
        super().__init__(message, param="messages")


class BadChatTemplate(FreeTokenError):
    """The model's template itself is broken: it does not compile, or it tried something the
    sandbox forbids (attribute escapes such as `''.__class__`). A 500: not the client's fault."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (no way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805  (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore-prefixed names ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body,
    unchanged. FreeToken needs no assistant masks, only that such templates compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """NOTE: jinja's sandbox answers an unsafe attribute (`''.__class__`) with an Undefined that
    renders as "" and only fails when used further; here it fails at once, with a clear error."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source). Raises `BadChatTemplate` on a syntax error."""
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise BadChatTemplate(
            f"the model's chat template does not compile: {e} (line {e.lineno})"
        ) from e


def _plain(value: Any) -> Any:
    """Plain JSON-shaped copies of what the template sees (no caller objects in the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list | None = None,
    documents: list | None = None,
    **kwargs: Any,
) -> str:
    """`messages` rendered with `template`, exactly as transformers' `apply_chat_template(...,
    tokenize=False)`. Keys whose value is None are dropped from each message first (OpenAI
    clients send `content: null` / `tool_calls: null`), as transformers does."""
    if not template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    compiled = compile_chat_template(template)
    chat = []
    for m in messages:
        m = _plain(m)
        if not isinstance(m, dict):
            raise ChatTemplateError(f"each message must be an object, got {type(m).__name__}")
        chat.append({k: v for k, v in m.items() if v is not None})
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(kwargs),
        )
    except SecurityError as e:
        raise BadChatTemplate(f"the chat template was stopped by the sandbox: {e}") from e
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}"
        ) from e
