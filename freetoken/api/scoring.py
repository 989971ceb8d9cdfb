"""The scoring routes, /v1/generative-scores and /v1/score: one plan, one engine path.

A plan (protocol/scoring.py) becomes a tree of engine requests, all submitted up front so they
share steps:
  * root: the prompt prefix every item shares (the query, when it comes first), computed once
    (max_tokens 0);
  * one per item, forked from the root (its KV shared, scheduler.py): its last position's
    full-vocabulary logprobs of every label's first token (logprob_token_ids, one sampled
    token that is thrown away);
  * one per item and multi-token label, forked from the item: prompt + label, scored from the
    label's second token on (prompt_logprobs_start), so only the label's own tokens are
    computed.
A label's logprob is the sum of its tokens' logprobs. Single-token labels take the item's row
only: the same numbers whichever field sent them. Deadlines, engine death, disconnects and
shutdown are handled as for generation (generation.py): every engine request is aborted.

What it is not: validation and response shapes (protocol/scoring.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.api.body import BodyReader, decode_json
from freetoken.api.generation import OFF_LOOP_BYTES, Generation
from freetoken.api.middleware import access_log
from freetoken.engine.sampling_params import SamplingParams
from freetoken.errors import InvalidRequest
from freetoken.protocol.scoring import (
    LabelScore,
    ScoringPlan,
    generative_scores_response,
    parse_scoring,
    score_response,
    scoring_usage,
)


@dataclass(slots=True)
class _Node:
    """One engine request of a plan, and what came back."""

    request_id: str
    stream: AsyncIterator
    item: int | None = None  # None: the shared root
    label: int | None = None  # None: the item's own request
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_computed: int = 0  # prompt tokens it computed (not served by a fork or the cache)


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one of its own to compute."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n


class Scoring:
    """The two scoring routes over the generation routes' engine and bookkeeping."""

    def __init__(self, gen: Generation, reader: BodyReader):
        self.gen = gen
        self.engine = gen.engine
        self.reader = reader
        self.metrics = gen.metrics

    async def generative_scores(self, request: Request) -> Response:
        return await self._score(request, sglang=False)

    async def score(self, request: Request) -> Response:
        return await self._score(request, sglang=True)

    def _parse(self, raw: bytes, sglang: bool) -> ScoringPlan:
        plan = parse_scoring(decode_json(raw), self.reader.limits, self.reader.tokenizer,
                             sglang=sglang)
        self.reader.check_model(plan.model)
        need, cap = plan.num_sequences, self.gen.max_queue_len
        if need > cap:
            raise InvalidRequest(
                f"This request needs {need} sequences (1 + items x (1 + multi-token labels) = "
                f"1 + {len(plan.prompts)} x {1 + len(plan.multi_token_labels)}), more than the "
                f"server's queue holds ({cap}, --max-queue-len)",
                param="items",
            )
        return plan

    def _submit(self, plan: ScoringPlan, rid: str) -> list[_Node]:
        nodes: list[_Node] = []

        def submit(ids, params, erid, fork_from=None, **where) -> str:
            stream = self.engine.submit(ids, params, request_id=erid, fork_from=fork_from)
            self.gen.inflight.add(erid)
            nodes.append(_Node(erid, stream, **where))
            return erid

        firsts = list(dict.fromkeys(lab[0] for lab in plan.labels))
        item_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                     logprob_token_ids=firsts)
        multi = plan.multi_token_labels
        try:
            shared = shared_prefix_len(plan.prompts)
            root = None
            if shared:
                root = submit(plan.prompts[0][:shared], SamplingParams(max_tokens=0),
                              f"{rid}-q")
            for i, prompt in enumerate(plan.prompts):
                item = submit(prompt, item_params, f"{rid}-{i}", root, item=i)
                for j in multi:
                    params = SamplingParams(max_tokens=0, prompt_logprobs=0,
                                            prompt_logprobs_start=len(prompt) + 1)
                    submit(prompt + plan.labels[j], params, f"{rid}-{i}-{j}", item,
                           item=i, label=j)
        except BaseException:
            self._abort(nodes)
            raise
        return nodes

    def _abort(self, nodes: list[_Node]) -> None:
        for node in nodes:
            self.engine.abort(node.request_id)
            self.gen.inflight.discard(node.request_id)

    async def _collect(self, request: Request, nodes: list[_Node], t0: float) -> None:
        async def run(node: _Node):
            async for out in node.stream:
                self.gen.check_output(out)
                if out.logprobs:
                    node.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    node.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    node.num_computed = out.num_prompt_tokens - out.num_cached_tokens

        work = asyncio.gather(*(run(node) for node in nodes))
        try:
            await self.gen.await_work(request, work, t0, lambda: self._abort(nodes))
        finally:
            self.gen.inflight.difference_update(node.request_id for node in nodes)

    @staticmethod
    def _results(plan: ScoringPlan, nodes: list[_Node]) -> list[list[LabelScore]]:
        first: dict[int, dict[int, float]] = {}   # item -> {first token id: logprob}
        rest: dict[tuple[int, int], list[float]] = {}  # (item, label) -> its later tokens'
        for node in nodes:
            if node.item is None:
                continue
            if node.label is None:
                first[node.item] = dict(node.logprobs[0].extra)
            else:
                start = len(plan.prompts[node.item]) + 1
                rest[node.item, node.label] = [
                    lp.logprob for lp in node.prompt_logprobs[start:]]
        out = []
        for i in range(len(plan.prompts)):
            scores = []
            for j, lab in enumerate(plan.labels):
                lps = [first[i][lab[0]], *rest.get((i, j), ())]
                scores.append(LabelScore(list(lab), lps))
            out.append(scores)
        return out

    async def _score(self, request: Request, sglang: bool) -> Response:
        t0 = time.perf_counter()
        info = access_log(request)
        rid = ("score-" if sglang else "generative-score-") + info["id"]
        raw = await self.reader.read(request)
        if len(raw) > OFF_LOOP_BYTES:
            plan = await asyncio.to_thread(self._parse, raw, sglang)
        else:
            plan = self._parse(raw, sglang)
        if not sglang and plan.request.request_id:
            rid = f"generative-score-{plan.request.request_id}"
        nodes = self._submit(plan, rid)
        await self._collect(request, nodes, t0)
        results = self._results(plan, nodes)
        usage = scoring_usage(plan, sum(node.num_computed for node in nodes))
        info["prompt_tokens"] = usage["prompt_tokens"]
        info["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        m = self.metrics
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.cached_tokens.inc(info["cached_tokens"])
        m.e2e.observe(time.perf_counter() - t0)
        route = "score" if sglang else "generative-scores"
        m.scored_items.labels(route).inc(len(plan.prompts))
        m.scored_labels.labels(route).inc(len(plan.prompts) * len(plan.labels))
        model = self.reader.served_model_name
        if sglang:
            return JSONResponse(score_response(plan, results, usage, model))
        return JSONResponse(generative_scores_response(plan, results, usage, rid, model))
