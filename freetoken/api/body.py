"""What every POST body goes through: the size limit, JSON decoding, the lone-surrogate check,
then protocol.py's parsing and the `model` field against the served model name -- the same for
every route that takes a body (generation, render, tokenize).

What it is not: request validation (protocol.py checks fields, types and ranges against the
model's limits); nothing here knows a field other than `model`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from freetoken.errors import BodyTooLarge, InvalidRequest, NotFound
from freetoken.protocol.parse import ParsedRequest, parse_chat, parse_completion

if TYPE_CHECKING:
    from freetoken.engine import EngineLimits
    from freetoken.tokenizer import Tokenizer


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class BodyReader:
    """Reads the POST bodies of one served model."""

    tokenizer: Tokenizer
    limits: EngineLimits
    served_model_name: str
    max_batch_prompts: int
    max_body_bytes: int

    async def read(self, request: Request) -> bytes:
        """The raw body; a 413 as soon as it is known to exceed `max_body_bytes` (from the
        Content-Length header, else while it streams in)."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BodyTooLarge(f"The request body exceeds {limit} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"The request body exceeds {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(self, request: Request) -> Any:
        return decode_json(await self.read(request))

    def parse_generation(self, body: Any, chat: bool) -> ParsedRequest:
        """A decoded /v1/completions or /v1/chat/completions body, parsed as the engine will
        see it (the render routes answer with exactly this)."""
        if chat:
            parsed = parse_chat(body, self.limits, self.tokenizer)
        else:
            parsed = parse_completion(
                body, self.limits, self.tokenizer, max_batch_prompts=self.max_batch_prompts
            )
        self.check_model(parsed.model)
        return parsed

    def check_model(self, model: str | None) -> None:
        """A 404 for a `model` other than the one served; None (the field left out) passes."""
        if model is not None and model != self.served_model_name:
            raise NotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):  # NOTE: only JSON escapes can smuggle in a lone one
        _check_surrogates(body)
    return body


def _check_surrogates(body: Any) -> None:
    """A lone UTF-16 surrogate ("\\ud800") is valid JSON but not Unicode text: it cannot be
    tokenized or even written back in an error message. A 400 naming where it is."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                name = f"{where}.{k}" if where else str(k)
                if not _is_utf8(k):
                    raise InvalidRequest(
                        "A field name holds a lone UTF-16 surrogate, which is not valid Unicode",
                        param=where or None,
                    )
                stack.append((v, name))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str) and not _is_utf8(value):
            raise InvalidRequest(
                f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode", param=where
            )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
