"""The tokenizer: text <-> token ids, built on Hugging Face `tokenizers`, from a GGUF or an HF dir.

Two constructors, one object:

* `Tokenizer.from_gguf(path_or_reader)`: the model's tokenizer rebuilt from the GGUF's own
  vocabulary (gguf_vocab.py does the rebuilding).
* `Tokenizer.from_hf_dir(dir)` reads `tokenizer.json` + `tokenizer_config.json` (+ the chat
  template from `chat_template.jinja` / `chat_template.json` when present).

BOS policy: `encode(text)` prepends BOS iff the model says so (GGUF `tokenizer.ggml.add_bos_token`,
HF `add_bos_token`) and `add_special_tokens` allows it. The inner `tokenizers` object never adds
anything itself; this class owns BOS/EOS. Chat text (`apply_chat_template`) already carries every
special token its template writes, so callers encode it with `add_special_tokens=False`
(`encode_chat` does that): no double BOS.

IncrementalDetokenizer streams a sequence's text as its ids arrive (the engine keeps one per
request).

Not here: model EOS from `generation_config.json`/`config.json` (the loader unions those with
`eos_token_ids`), request validation (protocol), and the template engine (chat_template.py).
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from freetoken.chat_template import render_chat_template
from freetoken.tokenizer.byte_level import byte_decoder
from freetoken.tokenizer.gguf_vocab import read_gguf_vocab

logger = logging.getLogger("freetoken.tokenizer")


class Tokenizer:
    """One model's tokenizer. See the module docstring for the BOS policy.

    Thread-safe for encode/decode (the Rust tokenizer is immutable after construction).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        byte_level: bool,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        add_eos_token: bool = False,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        source: str = "",
    ):
        self._hf = hf
        self.byte_level = byte_level
        # max id + 1, not the count: a GGUF may list one piece twice (the later id is a hole).
        self.vocab_size: int = max(
            hf.get_vocab_size(with_added_tokens=True),
            1 + max(hf.get_vocab(with_added_tokens=True).values(), default=-1),
        )
        for name, value in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
            ("unk_token_id", unk_token_id),
        ):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"{name} {value} is outside the vocabulary (size {self.vocab_size})"
                )
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.bos_token = None if bos_token_id is None else hf.id_to_token(bos_token_id)
        self.eos_token = None if eos_token_id is None else hf.id_to_token(eos_token_id)
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.add_eos_token = bool(add_eos_token) and eos_token_id is not None
        eos = [eos_token_id] if eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*eos, *(i for i in eos_token_ids if 0 <= i < self.vocab_size)])
        )
        self.chat_template = chat_template
        self.source = source
        added = hf.get_added_tokens_decoder()  # id -> AddedToken
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        special = {i for i, t in added.items() if t.special}
        special.update(
            i
            for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id)
            if i is not None and i in self._added
        )
        self.all_special_ids: list[int] = sorted(special)
        self._special_set = frozenset(special)
        self._token_bytes: list[bytes | None] = [None] * self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, add_bos_token={self.add_bos_token}, source={self.source!r})"
        )

    # ---- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text ("<|im_start|>") are matched
        whole. BOS (EOS) is added iff the model asks for it and `add_special_tokens`."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_id)
        return ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        out = [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens and (self.add_bos_token or self.add_eos_token):
            head = [self.bos_token_id] if self.add_bos_token else []
            tail = [self.eos_token_id] if self.add_eos_token else []
            out = [head + ids + tail for ids in out]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids with no token (negative, >= vocab_size) contribute nothing."""
        n = self.vocab_size
        return self._hf.decode([i for i in ids if 0 <= i < n], skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary piece (byte-level spelling, e.g. 'Ġhello')."""
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        return piece

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token contributes to the text (possibly part of one character).

        Added/special tokens contribute their text; byte-level pieces are mapped back to bytes;
        SentencePiece pieces give `<0xNN>` -> that byte and '▁' -> ' '. An id with no token (a
        model's padded vocabulary rows, >= vocab_size) contributes b"", as `decode` skips it."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        cached = self._token_bytes[token_id]
        if cached is None:
            cached = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = byte_decoder()
            try:
                return bytes(table[c] for c in piece)
            except KeyError:  # a piece outside the byte alphabet: it is its own text
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    # ---- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered with the model's own template (or `chat_template`), as
        transformers renders it; extra keywords (`tools`, `enable_thinking`, ...) reach the
        template. The text already holds every special token the template writes (BOS
        included): encode it with `add_special_tokens=False` (or call `encode_chat`)."""
        kwargs.setdefault("bos_token", self.bos_token)
        kwargs.setdefault("eos_token", self.eos_token)
        for name, tid in (("pad_token", self.pad_token_id), ("unk_token", self.unk_token_id)):
            if tid is not None:
                kwargs.setdefault(name, self._hf.id_to_token(tid))
        return render_chat_template(
            chat_template or self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt ids for a chat request: the rendered template, no BOS beyond what it writes."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | Path | Any) -> Tokenizer:
        """From a GGUF file's own vocabulary (gguf_vocab.py). `source` is a path or an open
        GGUFFile (loader/gguf_file.py; the loader passes its own so the file is parsed once)."""
        vocab = read_gguf_vocab(source)
        tok = cls(vocab.hf, **vocab.options)
        logger.info(
            "tokenizer from GGUF: model=%s pre=%s vocab=%d bos=%s eos=%s add_bos=%s",
            vocab.model,
            vocab.pre,
            tok.vocab_size,
            tok.bos_token,
            tok.eos_token,
            tok.add_bos_token,
        )
        return tok

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """From a Hugging Face model dir: tokenizer.json + tokenizer_config.json."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(
                f"{d}: no tokenizer.json (only fast-tokenizer checkpoints are supported)"
            )
        hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        config = _read_json(d / "tokenizer_config.json")

        def special_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return hf.token_to_id(value) if isinstance(value, str) else None

        bos, eos = special_id("bos_token"), special_id("eos_token")
        # NOTE: the flag wins when present (SPEC: "HF add_bos_token"); transformers 5 instead
        # always follows tokenizer.json's post-processor. Real checkpoints agree on both.
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # no flag: follow what the tokenizer.json post-processor would add
            probe = hf.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(probe) > 1 and probe[0] == bos
        gen = _read_json(d / "generation_config.json")
        gen_eos = gen.get("eos_token_id", [])
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        tok = cls(
            hf,
            byte_level=_has_byte_level_decoder(hf),
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=add_bos,
            add_eos_token=bool(config.get("add_eos_token", False)),
            eos_token_ids=gen_eos,
            pad_token_id=special_id("pad_token"),
            unk_token_id=special_id("unk_token"),
            chat_template=_hf_chat_template(d, config),
            source=str(d),
        )
        logger.info(
            "tokenizer from %s: vocab=%d bos=%s eos=%s add_bos=%s",
            d,
            tok.vocab_size,
            tok.bos_token,
            tok.eos_token,
            tok.add_bos_token,
        )
        return tok


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hf_chat_template(d: Path, config: dict) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(d / "chat_template.json").get(
        "chat_template", config.get("chat_template")
    )
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _has_byte_level_decoder(hf: HFTokenizer) -> bool:
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(json.loads(hf.to_str()).get("decoder"))


class IncrementalDetokenizer:
    """Streams text as ids arrive, never emitting half a UTF-8 character.

    Each token contributes `tok.token_bytes(id)`; an incremental UTF-8 decoder holds back a
    trailing incomplete character until its last byte arrives (invalid bytes become U+FFFD, as
    in `decode`). For byte-level BPE the concatenated output equals `tok.decode(all_ids)`.
    NOTE: for SentencePiece tokenizers `decode()` strips the sequence's first leading space;
    this keeps it, which is what a continuation of a prompt should show.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tok
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: Iterable[int]) -> str:
        tok = self._tok
        data = b"".join(
            tok.token_bytes(i) for i in ids if not (self._skip and i in tok._special_set)
        )
        return self._utf8.decode(data) if data else ""

    def flush(self) -> str:
        """End of stream: whatever is held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        return len(self._utf8.getstate()[0])
