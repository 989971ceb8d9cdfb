"""What routers in front of several FreeToken replicas ask a backend for (docs/scale-out.md).

- `POST /v1/completions/render`, `POST /v1/chat/completions/render`: vLLM's render endpoints.
  vllm-router's `cache_aware` policy calls them (on every healthy worker) before it routes a text
  or chat request, and keys its prefix tree on the token ids they return; without them it falls
  back to `/tokenize`, then to raw text. The body is validated exactly as the generation request
  would be (same 400 / 404), the prompt is tokenized exactly as the engine would see it, and
  nothing is generated. Shapes (vLLM's tests/entrypoints/openai/cpu/test_render.py):
    completions -> a list, one entry per prompt:
        {"request_id", "prompt", "prompt_token_ids", "token_ids", "model", "sampling_params",
         "stream", "stream_options"}
    chat        -> one object: {"request_id", "token_ids", "model", "sampling_params",
         "stream", "stream_options"}
  `prompt_token_ids` (older vLLM) and `token_ids` (vLLM's GenerateRequest) carry the same ids;
  vllm-router 0.1.17 accepts either.
- `GET /get_load`: `{"load": N, ...}`, what vllm-router 0.1.17 (and the sgl-router it was forked
  from) parses -- its background load monitor and `GET /get_loads` read the top-level `load`
  integer (an SGLang <= 0.4 worker answered `{"load": ...}`); a worker without it shows `-1`.
  FreeToken's `load` is the requests it holds, running + waiting. The same object also carries
  the per-rank fields of SGLang's later shape: `dp_rank`, `num_reqs` (running + waiting),
  `num_waiting_reqs`, `num_tokens` (KV tokens in use), `num_pending_tokens` (KV tokens free),
  `ts_tic`.
- `GET /loads` (also `/v1/loads`): the fuller report, `{"timestamp", "loads": [{"dp_rank",
  "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
  "token_usage", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
  "prefix_cache_hit_rate"}]}`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken import protocol


def _sampling_dict(params) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    if isinstance(out.get("logit_bias"), dict):
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


def _stream_options(parsed: protocol.ParsedRequest) -> dict | None:
    opts = getattr(parsed.request, "stream_options", None)
    return opts.model_dump() if opts is not None else None


def load_report(engine) -> dict[str, Any]:
    """One rank's numbers from engine.stats(): the source of /get_load and /loads."""
    s = dict(engine.stats() or {})
    block_size = int(getattr(getattr(engine, "config", None), "block_size", 1) or 1)
    running = int(s.get("num_running", s.get("running", 0)))
    waiting = int(s.get("num_waiting", s.get("waiting", 0)))
    used_blocks = int(s.get("kv_blocks_used", 0))
    total_blocks = int(s.get("kv_blocks_total", 0))
    queries = int(s.get("prefix_queries", 0))
    hits = int(s.get("prefix_hits", 0))
    usage = used_blocks / total_blocks if total_blocks else 0.0
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used_blocks * block_size,
        "max_total_num_tokens": total_blocks * block_size,
        "token_usage": usage,
        "kv_cache_usage": usage,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


class _ScaleOut:
    def __init__(self, h):
        self.h = h  # server._Handlers: engine, tokenizer, limits, model name, body reader

    async def completions_render(self, request: Request) -> Response:
        h = self.h
        body = await h._json(request)
        parsed = protocol.parse_completion(
            body, h.limits, h.tok, max_batch_prompts=h.max_batch_prompts
        )
        h._check_model(parsed.model)
        rid = "cmpl-" + uuid.uuid4().hex
        sampling = _sampling_dict(parsed.params)
        out = []
        for i, prompt in enumerate(parsed.prompts):
            text = prompt.text
            if text is None:
                text = h.tok.decode(prompt.ids, skip_special_tokens=False)
            out.append(
                {
                    "request_id": f"{rid}-{i}",
                    "prompt": text,
                    "prompt_token_ids": list(prompt.ids),
                    "token_ids": list(prompt.ids),
                    "model": h.model_name,
                    "sampling_params": sampling,
                    "stream": parsed.stream,
                    "stream_options": _stream_options(parsed),
                }
            )
        return JSONResponse(out)

    async def chat_render(self, request: Request) -> Response:
        h = self.h
        body = await h._json(request)
        parsed = protocol.parse_chat(body, h.limits, h.tok)
        h._check_model(parsed.model)
        return JSONResponse(
            {
                "request_id": "chatcmpl-" + uuid.uuid4().hex,
                "token_ids": list(parsed.prompts[0].ids),
                "model": h.model_name,
                "sampling_params": _sampling_dict(parsed.params),
                "stream": parsed.stream,
                "stream_options": _stream_options(parsed),
            }
        )

    async def get_load(self, request: Request) -> Response:
        r = load_report(self.h.engine)
        reqs = r["num_running_reqs"] + r["num_waiting_reqs"]
        return JSONResponse(
            {
                "load": reqs,
                "dp_rank": r["dp_rank"],
                "num_reqs": reqs,
                "num_waiting_reqs": r["num_waiting_reqs"],
                "num_tokens": r["num_used_tokens"],
                "num_pending_tokens": r["max_total_num_tokens"] - r["num_used_tokens"],
                "ts_tic": time.perf_counter(),
            }
        )

    async def loads(self, request: Request) -> Response:
        return JSONResponse({"timestamp": time.time(), "loads": [load_report(self.h.engine)]})


def scaleout_routes(h) -> list[Route]:
    """The routes above over the server's handlers `h`. Also labels the vllm:* metrics with the
    served model name (metrics.py), so routers and dashboards that filter on `model_name` match."""
    if getattr(h, "metrics", None) is not None:
        h.metrics.model_name = h.model_name
    s = _ScaleOut(h)
    return [
        Route("/v1/completions/render", s.completions_render, methods=["POST"]),
        Route("/v1/chat/completions/render", s.chat_render, methods=["POST"]),
        Route("/get_load", s.get_load, methods=["GET"]),
        Route("/loads", s.loads, methods=["GET"]),
        Route("/v1/loads", s.loads, methods=["GET"]),
    ]
