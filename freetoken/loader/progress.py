"""The loaders' progress line on stderr, rewritten in place while a model loads."""

from __future__ import annotations

import sys


def progress(message: str) -> None:
    """Show `message` as the current progress line (\r: the next one replaces it)."""
    print(f"\r{message}", end="", file=sys.stderr, flush=True)


def progress_done() -> None:
    """End the progress line."""
    print(file=sys.stderr, flush=True)
