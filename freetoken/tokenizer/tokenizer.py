"""The tokenizer: text <-> token ids, built on Hugging Face `tokenizers`, from a GGUF or an HF dir.

Two constructors, one object:

* `Tokenizer.from_gguf(path_or_reader)` rebuilds the model's tokenizer from the GGUF's own
  vocabulary (`tokenizer.ggml.*`): tokens, merges, token types and the `tokenizer.ggml.pre`
  pre-tokenizer, split the way llama.cpp splits (that is the model's real tokenizer; see
  `_PRE_TOKENIZERS`). Control tokens become special added tokens, user-defined ones plain added
  tokens, so both are matched whole in text, as llama.cpp does with `parse_special`.
* `Tokenizer.from_hf_dir(dir)` reads `tokenizer.json` + `tokenizer_config.json` (+ the chat
  template from `chat_template.jinja` / `chat_template.json` when present).

BOS policy: `encode(text)` prepends BOS iff the model says so (GGUF `tokenizer.ggml.add_bos_token`,
HF `add_bos_token`) and `add_special_tokens` allows it. The inner `tokenizers` object never adds
anything itself; this class owns BOS/EOS. Chat text (`apply_chat_template`) already carries every
special token its template writes, so callers encode it with `add_special_tokens=False`
(`encode_chat` does that): no double BOS.

Not here: model EOS from `generation_config.json`/`config.json` (the loader unions those with
`eos_token_ids`), request validation (protocol), and the template engine (chat_template.py).
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from freetoken.chat_template import render_chat_template

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type) that matter here.
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# The split regexes, in the form the models' own tokenizer.json files spell them (the `tokenizers`
# library runs Oniguruma, which takes them as written; llama.cpp keeps "adapted" twins of these for
# its own regex engine).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (splits applied in order, each isolating its matches; ignore_merges).
# NOTE: "smollm" (and starcoder & co.) first isolates every single digit, then applies GPT-2's
# regex to each piece: llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM and the original SmolLM2
# tokenizer.json (Digits(individual_digits) + ByteLevel). transformers' GGUF converter leaves the
# digit split out, so it differs from the model when 2+ spaces precede a digit ("   42").
_DIGITS = r"\p{N}"
_PRE_FAMILIES: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt2": ((_GPT2_SPLIT,), False),
    "smollm": ((_DIGITS, _GPT2_SPLIT), False),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "gpt4o": ((_GPT4O_SPLIT,), False),
}
_PRE_TOKENIZERS: dict[str, str] = {
    name: family
    for family, names in {
        "gpt2": "gpt-2 gpt2 mpt olmo jais phi-2 trillion granite-docling default",
        "smollm": "smollm starcoder refact command-r codeshell exaone minerva-7b",
        "llama3": "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx "
        "smaug-bpe",
        "qwen2": "qwen2 deepseek-r1-qwen stablelm2 megrez hunyuan",
        "gpt4o": "gpt-4o llama4 minimax-m2",
    }.items()
    for name in names.split()
}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in char -> the byte it spells."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _byte_level_pre_tokenizer(family: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    splits, ignore_merges = _PRE_FAMILIES[family]
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), ignore_merges


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces
    that are both in the vocabulary, best (highest-score) resulting piece first; ties by longer
    left, then longer right part, then vocabulary order (the order transformers derives)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                key = (
                    -scores[piece_id],
                    -len(left),
                    -len(right),
                    piece_id,
                    vocab[left],
                    vocab[right],
                )
                ranked.append((key, left, right))
    ranked.sort()
    return [(left, right) for _, left, right in ranked]


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
            table = _byte_decoder()
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
        """From a GGUF file's own vocabulary. `source` is a path or an open `gguf.GGUFReader`
        (the loader passes its reader so the file is parsed once)."""
        import gguf

        reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))
        path = str(getattr(reader.data, "filename", None) or source)

        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else _field_value(field)

        model_type = get("tokenizer.ggml.model")
        tokens: list[str] = get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ValueError(f"{path}: no tokenizer.ggml.tokens in this GGUF")
        types: list[int] = get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        extra_eos = [get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")]
        common = dict(
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=[i for i in extra_eos if i is not None],
            pad_token_id=get("tokenizer.ggml.padding_token_id"),
            unk_token_id=get("tokenizer.ggml.unknown_token_id"),
            add_eos_token=bool(get("tokenizer.ggml.add_eos_token", False)),
            chat_template=get("tokenizer.chat_template"),
            source=path,
        )

        if model_type == "gpt2":
            hf, pre = _gguf_byte_level(
                tokens, types, get("tokenizer.ggml.merges") or [], get("tokenizer.ggml.pre")
            )
            # Without the flag llama.cpp adds BOS for the Llama 3 family only.
            llama3 = _PRE_TOKENIZERS.get(get("tokenizer.ggml.pre") or "default") == "llama3"
            add_bos = bool(get("tokenizer.ggml.add_bos_token", llama3))
            tok = cls(hf, byte_level=True, add_bos_token=add_bos, **common)
        elif model_type == "llama":
            scores = get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            hf = _gguf_sentencepiece(
                tokens,
                types,
                scores,
                common["unk_token_id"],
                bool(get("tokenizer.ggml.add_space_prefix", True)),
            )
            pre = "sentencepiece"
            # Older files carry no flag, and llama.cpp adds BOS to SentencePiece vocabularies.
            add_bos = bool(get("tokenizer.ggml.add_bos_token", True))
            tok = cls(hf, byte_level=False, add_bos_token=add_bos, **common)
        else:
            raise ValueError(
                f"{path}: tokenizer.ggml.model {model_type!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
            )
        logger.info(
            "tokenizer from GGUF: model=%s pre=%s vocab=%d bos=%s eos=%s add_bos=%s",
            model_type,
            pre,
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


def _field_value(field: Any) -> Any:
    """A GGUF metadata value as Python data (`ReaderField.contents()` where gguf has it)."""
    if hasattr(field, "contents"):
        return field.contents()
    import gguf  # older gguf: decode the parts by hand

    def one(i: int, kind: Any) -> Any:
        part = field.parts[i]
        return bytes(part).decode("utf-8") if kind == gguf.GGUFValueType.STRING else part[0].item()

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(i, field.types[-1]) for i in field.data]
    return one(field.data[0], field.types[0])


def _gguf_byte_level(
    tokens: list[str], types: list[int], merges: list[str], pre: str | None
) -> tuple[HFTokenizer, str]:
    family = _PRE_TOKENIZERS.get(pre or "default")
    if family is None:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    if pre in (None, "default"):
        logger.warning("GGUF names no tokenizer.ggml.pre; splitting text as GPT-2 does")
    alphabet = _byte_decoder()
    spell = {b: c for c, b in alphabet.items()}
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not alphabet.keys() >= set(t):
            t = "".join(spell[b] for b in t.encode("utf-8"))  # a raw-text piece: respell it
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre_tok, ignore_merges = _byte_level_pre_tokenizer(family)
    hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tok
    hf.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(hf, tokens, types)
    return hf, pre or "default"


def _gguf_sentencepiece(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    hf = HFTokenizer(
        models.BPE(
            vocab, _spm_merges(tokens, scores), unk_token=unk, byte_fallback=True, fuse_unk=True
        )
    )
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(dec)
    _add_gguf_special_tokens(hf, tokens, types)
    return hf


def _add_gguf_special_tokens(hf: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # NOTE: llama.cpp matches both CONTROL and USER_DEFINED tokens whole in text; only CONTROL
    # ones are hidden when detokenizing without specials, so only they are `special` here.
    added = [
        AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    special = [a for a in added if a.special]
    plain = [a for a in added if not a.special]
    if special:
        hf.add_special_tokens(special)
    if plain:
        hf.add_tokens(plain)


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
