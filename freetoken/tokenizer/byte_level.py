"""GPT-2's byte-level alphabet: each of the 256 bytes spelled as one printable character.

Its own module because two others read it: the runtime Tokenizer maps a byte-level piece back
to the bytes it stands for (token_bytes), and the GGUF rebuild (gguf_vocab.py) respells raw-text
pieces into it. Not here: anything about a particular vocabulary.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
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
