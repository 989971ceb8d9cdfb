"""Text <-> token ids: the runtime Tokenizer (tokenizer.py), built from an HF dir or rebuilt from a
GGUF's own vocabulary (gguf_vocab.py), and the IncrementalDetokenizer the engine streams with."""

from freetoken.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
