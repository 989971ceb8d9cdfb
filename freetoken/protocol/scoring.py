"""The scoring routes' bodies: /v1/generative-scores (vLLM's shape) and /v1/score (SGLang's).

What it is for: the two request models, `parse_scoring` (a body -> a ScoringPlan: one token-id
prompt per item, the labels as token-id lists, every refusal naming its field and position),
the label arithmetic (`label_probs`) and the two response shapes. Both routes share one plan
and one engine path (api/scoring.py); they differ only in field defaults and response shape.
What it is not: running the plan (api/scoring.py) or the generation routes' requests.

Prompt rule (docs/api.md): a text part is tokenized on its own, so the query's ids are the same
for every item and its KV is shared. Special tokens (BOS) are added, when add_special_tokens,
only to the part that comes first -- never mid-prompt -- and never to a label.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field

from freetoken.errors import InvalidRequest
from freetoken.protocol import limits
from freetoken.protocol.parse import check_unsupported
from freetoken.protocol.prompts import encode_text
from freetoken.protocol.requests import (
    NeutralOnly,
    _schema_any,
    _Strict,
    validate_model,
)
from freetoken.protocol.responses import usage_dict

MAX_ITEMS = 1024  # items per scoring request
MAX_LABELS = 256  # labels (or label_token_ids) per scoring request

_IDS = {"type": "array", "items": {"type": "integer"}}
_QUERY = {"anyOf": [{"type": "string"}, _IDS]}
_TEXTS = {"type": "array", "items": {"type": "string"}}
_ITEMS = {"anyOf": [_TEXTS, {"type": "array", "items": _IDS}]}
_LABELS = {"type": "array", "items": {"anyOf": [{"type": "string"}, _IDS]}}


class _ScoringFields(_Strict):
    model: str | None = None
    query: _schema_any(_QUERY, "text, or token ids used exactly")
    items: _schema_any(_ITEMS, "texts or token-id arrays, one per item")
    label_token_ids: list[int] | None = Field(
        None, description="single-token labels (the peers' field); exclusive with labels"
    )
    labels: _schema_any(_LABELS, "FreeToken: multi-token labels, texts or token-id arrays") = None
    item_first: bool = False
    add_special_tokens: bool = True


class GenerativeScoreRequest(_ScoringFields):
    """POST /v1/generative-scores (vLLM's GenerativeScoreRequest)."""

    apply_softmax: bool = True
    # vLLM accepts these and they change nothing there (logprobs come before sampling): only
    # their neutral values are accepted, so nobody believes a temperature was applied
    temperature: Annotated[float | None, NeutralOnly(None, 0.0)] = Field(
        None, description="neutral only: 0"
    )
    top_k: Annotated[int | None, NeutralOnly(None, 0, -1)] = Field(
        None, description="neutral only: 0 or -1"
    )
    top_p: Annotated[float | None, NeutralOnly(None, 1.0)] = Field(
        None, description="neutral only: 1"
    )
    priority: Annotated[int | None, NeutralOnly(None, 0)] = Field(
        None, description="neutral only: 0"
    )
    request_id: str | None = Field(None, description="the response's id suffix")


class ScoreRequest(_ScoringFields):
    """POST /v1/score (SGLang's ScoringRequest; `items` may also be one string)."""

    items: _schema_any(
        {"anyOf": [{"type": "string"}, *_ITEMS["anyOf"]]}, "a text, texts or token-id arrays"
    )
    apply_softmax: bool = False


@dataclass(slots=True)
class ScoringPlan:
    """One scoring request, as the engine will run it."""

    request: BaseModel
    prompts: list[list[int]]  # per item: query + item (item + query with item_first)
    labels: list[list[int]]  # per label: its token ids (one each for label_token_ids)
    single_token: bool  # sent as label_token_ids: the peers' response fields
    apply_softmax: bool
    model: str | None

    @property
    def multi_token_labels(self) -> list[int]:
        """Indexes of the labels longer than one token (each needs its own sequence)."""
        return [j for j, lab in enumerate(self.labels) if len(lab) > 1]

    @property
    def num_sequences(self) -> int:
        """Engine requests the plan needs: a shared root, one per item, one per item and
        multi-token label."""
        return 1 + len(self.prompts) * (1 + len(self.multi_token_labels))


def parse_scoring(body: Any, engine_limits, tokenizer, *, sglang: bool) -> ScoringPlan:
    """A decoded body of /v1/score (`sglang`) or /v1/generative-scores -> its plan."""
    req = validate_model(ScoreRequest if sglang else GenerativeScoreRequest, body)
    check_unsupported(req)
    vocab = engine_limits.vocab_size

    def part(value: Any, where: str, special: bool) -> list[int]:
        if isinstance(value, str):
            return encode_text(tokenizer, value, where, special, vocab)
        if isinstance(value, list):
            limits.check_token_ids(value, vocab, where)
            return list(value)
        raise InvalidRequest(f"{where} must be a string or an array of token ids", param=where)

    items = [req.items] if sglang and isinstance(req.items, str) else req.items
    if not isinstance(items, list):
        raise InvalidRequest("items must be an array of strings or of token-id arrays",
                             param="items")
    if not items:
        raise InvalidRequest("items must contain at least one item", param="items")
    if len(items) > MAX_ITEMS:
        raise InvalidRequest(f"items holds {len(items)} items, more than {MAX_ITEMS}",
                             param="items")
    if len({isinstance(it, str) for it in items}) > 1:
        raise InvalidRequest("items must be all strings or all token-id arrays", param="items")
    # NOTE: specials go to whichever part opens the prompt (vLLM adds them to the query even
    # when the item comes first, which puts a BOS mid-prompt)
    special = req.add_special_tokens
    query = part(req.query, "query", special and not req.item_first)
    prompts = []
    for i, item in enumerate(items):
        ids = part(item, f"items[{i}]", special and req.item_first)
        prompt = ids + query if req.item_first else query + ids
        if not prompt:
            raise InvalidRequest(f"items[{i}]: query and item are both empty, nothing to score",
                                 param=f"items[{i}]")
        prompts.append(prompt)

    labels = _labels(req, part, vocab)
    longest = max(len(lab) for lab in labels)
    for i, prompt in enumerate(prompts):
        # the last label token needs no logits, but the engine computes its KV all the same
        limits.check_context(len(prompt), longest, engine_limits.max_model_len, f"items[{i}]")
    return ScoringPlan(req, prompts, labels, req.label_token_ids is not None,
                       req.apply_softmax, req.model)


def _labels(req: _ScoringFields, part, vocab: int) -> list[list[int]]:
    if (req.label_token_ids is None) == (req.labels is None):
        if req.labels is None:
            raise InvalidRequest("label_token_ids (or labels) is required",
                                 param="label_token_ids")
        raise InvalidRequest("label_token_ids and labels are exclusive: send one",
                             param="labels")
    if req.label_token_ids is not None:
        ids = req.label_token_ids
        if not ids:
            raise InvalidRequest("label_token_ids must contain at least one token id",
                                 param="label_token_ids")
        limits.check_token_ids(ids, vocab, "label_token_ids", max_len=MAX_LABELS)
        return [[t] for t in ids]
    raw = req.labels
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("labels must be a non-empty array of strings or token-id arrays",
                             param="labels")
    if len(raw) > MAX_LABELS:
        raise InvalidRequest(f"labels holds {len(raw)} labels, more than {MAX_LABELS}",
                             param="labels")
    out = []
    for j, lab in enumerate(raw):
        ids = part(lab, f"labels[{j}]", False)
        if not ids:
            raise InvalidRequest(f"labels[{j}] is empty", param=f"labels[{j}]")
        out.append(ids)
    return out


# ------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LabelScore:
    """One label after one item: each of its tokens' full-vocabulary logprob, in order."""

    token_ids: list[int]
    token_logprobs: list[float]

    @property
    def logprob(self) -> float:
        """The label's sequence logprob: the sum over its tokens."""
        return math.fsum(self.token_logprobs)

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "logprob": self.logprob,
                "token_logprobs": self.token_logprobs}


def label_probs(scores: list[LabelScore], apply_softmax: bool) -> list[float]:
    """Per label: the softmax over the labels' sequence logprobs (apply_softmax), else the
    model's own probability of the label, exp(logprob)."""
    lps = [s.logprob for s in scores]
    if not apply_softmax:
        return [math.exp(lp) for lp in lps]
    top = max(lps)
    if top == -math.inf:  # every label impossible: no distribution to normalise
        return [0.0] * len(lps)
    weights = [math.exp(lp - top) for lp in lps]
    total = math.fsum(weights)
    return [w / total for w in weights]


def scoring_usage(plan: ScoringPlan, num_computed: int) -> dict:
    """prompt_tokens: every item's prompt plus, for multi-token labels, every label after every
    item (what separate echo requests would send); cached_tokens: those not computed, because
    the query, an item or the prefix cache already held their KV."""
    prompt_tokens = sum(len(p) for p in plan.prompts)
    if not plan.single_token:
        prompt_tokens += len(plan.prompts) * sum(len(lab) for lab in plan.labels)
    return usage_dict(prompt_tokens, 0, max(0, prompt_tokens - num_computed))


def generative_scores_response(plan: ScoringPlan, results: list[list[LabelScore]],
                               usage: dict, rid: str, model: str) -> dict:
    """vLLM's shape: results[i].token_probs {"<id>": p}; with `labels`, label_probs and each
    label's logprobs instead."""
    out = []
    for i, scores in enumerate(results):
        probs = label_probs(scores, plan.apply_softmax)
        if plan.single_token:
            out.append({"index": i, "token_probs": {
                str(s.token_ids[0]): p for s, p in zip(scores, probs)}})
        else:
            out.append({"index": i, "label_probs": probs,
                        "labels": [s.to_dict() for s in scores]})
    return {"id": rid, "object": "generative_score", "created": int(time.time()),
            "model": model, "results": out, "usage": usage}


def score_response(plan: ScoringPlan, results: list[list[LabelScore]], usage: dict,
                   model: str) -> dict:
    """SGLang's shape: scores [[p per label] per item]; with `labels`, each label's logprobs
    too."""
    body = {"scores": [label_probs(scores, plan.apply_softmax) for scores in results],
            "model": model, "usage": usage, "object": "scoring"}
    if not plan.single_token:
        body["labels"] = [[s.to_dict() for s in scores] for scores in results]
    return body
