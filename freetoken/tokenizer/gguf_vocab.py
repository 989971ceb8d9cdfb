"""A Hugging Face `tokenizers` object rebuilt from a GGUF's own vocabulary (tokenizer.ggml.*).

read_gguf_vocab() turns the tokens, merges (or SentencePiece scores), token types and the
`tokenizer.ggml.pre` pre-tokenizer into the model's real tokenizer, split the way llama.cpp splits
(see `_PRE_TOKENIZERS`), plus the Tokenizer's options (BOS/EOS ids and flags, chat template) as
the file states them. Control tokens become special added tokens, user-defined ones plain added
tokens, so both are matched whole in text, as llama.cpp does with `parse_special`.

Not here: the runtime tokenizer (tokenizer.py, whose Tokenizer.from_gguf calls this), the model's
weights or config (freetoken/loader/gguf.py reads the same file).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from freetoken.tokenizer.byte_level import byte_decoder

logger = logging.getLogger("freetoken.tokenizer")

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


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """What a GGUF says about its tokenizer: the rebuilt inner tokenizer and Tokenizer's options."""

    hf: HFTokenizer
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) | "llama" (SPM)
    pre: str  # the pre-tokenizer applied ("sentencepiece" for "llama")
    options: dict[str, Any]  # the keyword arguments of Tokenizer(hf, ...)


def read_gguf_vocab(source: str | Path | Any) -> GGUFVocab:
    """The vocabulary of a GGUF. `source` is a path or an open GGUFFile (the loader passes its
    own so the file is parsed once); a `gguf.GGUFReader` is read again through its path."""
    import gguf

    from freetoken.loader.gguf_file import GGUFFile

    if isinstance(source, gguf.GGUFReader):
        source = source.data.filename
    file = source if isinstance(source, GGUFFile) else GGUFFile(source)
    path = file.path

    def get(key: str, default: Any = None) -> Any:
        value = file.get(key, default)
        return value.tolist() if hasattr(value, "tolist") else value  # arrays -> lists

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
        options = dict(byte_level=True, add_bos_token=add_bos, **common)
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
        options = dict(byte_level=False, add_bos_token=add_bos, **common)
    else:
        raise ValueError(
            f"{path}: tokenizer.ggml.model {model_type!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    return GGUFVocab(hf, model_type, pre, options)


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
    alphabet = byte_decoder()
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
