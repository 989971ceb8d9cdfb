"""Prompts: the four prompt forms of /v1/completions and the chat messages, as token ids.

What it is for: `normalize_prompt` (a string, a list of strings, a token-id array or a list of
them -> a list of Prompt; ids are used exactly, text is encoded with or without BOS as asked) and
`render_chat` (messages -> the chat template's text and its ids). Each refusal names the prompt
or message by position.
What it is not: the request models (protocol/requests.py) or the limits shared with the engine
(protocol/limits.py, which these call for ids, emptiness and context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.errors import InvalidRequest
from freetoken.protocol import limits
from freetoken.protocol.requests import ChatMessage


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    text: str | None  # the request's text, for text prompts


def encode_text(tokenizer, text: str, where: str, add_special_tokens: bool,
                vocab_size: int) -> list[int]:
    """`text` as ids; an id outside the model's vocabulary (an added token) is a 400 naming
    `where` and the position."""
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"{where}: the text tokenizes to id {t} at position {i}, outside the "
                f"vocabulary (0..{vocab_size - 1})",
                param=where,
            )
    return ids


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
        ids = encode_text(tokenizer, text, where, add_special_tokens, vocab_size)
        if not ids:
            raise InvalidRequest(
                f"{where}: the text yields no tokens and cannot be evaluated", param=where
            )
        return Prompt(ids, text)

    def id_list(ids: list, where: str) -> Prompt:
        limits.check_prompt_not_empty(ids, where)
        if context is not None:
            limits.check_context(len(ids), *context, None if where == "prompt" else where)
        limits.check_token_ids(ids, vocab_size, where)
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


def check_context(prompts: list[Prompt], max_tokens: int, max_model_len: int) -> None:
    """Each prompt plus max_tokens within the context; "prompt[i]: " names one of several."""
    for i, p in enumerate(prompts):
        where = f"prompt[{i}]" if len(prompts) > 1 else None
        limits.check_context(len(p.ids), max_tokens, max_model_len, where)


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
