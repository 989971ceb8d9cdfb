"""SamplingParams: the engine-facing, already validated form of a request's sampling fields.

protocol.py does the client-facing validation (400s naming the field); __post_init__ repeats only
the invariants the engine relies on and raises ValueError. Model-dependent checks (ids inside the
vocabulary, context length) happen in Engine.submit against EngineLimits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0            # 0 (or below 1e-5) = greedy
    top_p: float = 1.0                  # (0, 1]
    top_k: int = -1                     # -1 or 0 = the whole vocabulary
    min_p: float = 0.0                  # [0, 1]
    seed: int | None = None             # same seed, same tokens (counter-based RNG in ops)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                 # EOS / stop ids / stop strings cannot end it before this
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None         # top-K per generated token (0 = the chosen token only)
    logprob_token_ids: list[int] | None = None  # vLLM extension; needs logprobs
    prompt_logprobs: int | None = None  # top-K per prompt position (position 0 is None)
    presence_penalty: float = 0.0       # [-2, 2], over the generated tokens
    frequency_penalty: float = 0.0      # [-2, 2], over the generated tokens
    repetition_penalty: float = 1.0     # > 0, over prompt + generated tokens (vLLM semantics)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or an integer >= 0, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            tid = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k
            if not _is_int(tid) or tid < 0:
                raise ValueError(f"logit_bias key must be a token id, got {k!r}")
            if not _is_num(v) or not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias[{k}] must be in [-100, 100], got {v!r}")
            if v != 0:
                bias[tid] = float(v)
        self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = sorted(set(ids))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise ValueError("logprob_token_ids requires logprobs to be set")
            ids = list(self.logprob_token_ids)
            if any(not _is_int(t) or t < 0 for t in ids):
                raise ValueError(f"logprob_token_ids must be token ids, got {ids!r}")
            self.logprob_token_ids = ids
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def token_ids_referenced(self) -> list[int]:
        """Every token id the params name, for the engine's vocabulary check."""
        ids = list(self.stop_token_ids) + list(self.logit_bias)
        ids += self.allowed_token_ids or []
        ids += self.logprob_token_ids or []
        return ids
