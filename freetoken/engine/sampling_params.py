"""SamplingParams: the engine-facing, already validated form of a request's sampling fields.

freetoken.protocol does the client-facing validation (400s naming the field); __post_init__
checks only the invariants the engine relies on and raises ValueError (the rules it shares with
the protocol through protocol/limits.py raise InvalidRequest, a ValueError too). Model-dependent
checks (ids inside the vocabulary, context length) happen in Engine.submit against EngineLimits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.protocol import limits

_GREEDY_EPS = 1e-5


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
    prompt_logprobs_start: int = 1      # first position scored; earlier ones are None (scoring)
    presence_penalty: float = 0.0       # [-2, 2], over the generated tokens
    frequency_penalty: float = 0.0      # [-2, 2], over the generated tokens
    repetition_penalty: float = 1.0     # > 0, over prompt + generated tokens (vLLM semantics)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0                   # vLLM's: lower is scheduled first (engine/pressure.py)

    def __post_init__(self) -> None:
        if not limits.is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not limits.is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0
        if not limits.is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not limits.is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or an integer >= 0, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not limits.is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not limits.is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.stop = limits.stop_list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        limits.check_token_ids(self.stop_token_ids, None, "stop_token_ids")
        if not limits.is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        limits.check_min_tokens(self.min_tokens, self.max_tokens)
        bias = limits.logit_bias_ids(self.logit_bias, None)
        self.logit_bias = {tid: v for tid, v in bias.items() if v != 0}
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            limits.check_allowed_token_ids(ids, None)
            self.allowed_token_ids = sorted(set(ids))
        limits.check_logprobs(self.logprobs, None, "logprobs")
        limits.check_logprobs(self.prompt_logprobs, None, "prompt_logprobs")
        if not limits.is_int(self.prompt_logprobs_start) or self.prompt_logprobs_start < 1:
            raise ValueError("prompt_logprobs_start must be an integer >= 1, got "
                             f"{self.prompt_logprobs_start!r}")
        if self.logprob_token_ids is not None:
            ids = list(self.logprob_token_ids)
            limits.check_logprob_token_ids(ids, self.logprobs, None)
            self.logprob_token_ids = ids
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not limits.is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not limits.is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not limits.is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
