"""What routers in front of several FreeToken replicas ask a backend for (docs/scale-out.md).
What it is not: the routing itself (vllm-router, in front; freetoken/cluster.py starts both).

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

from freetoken.api.body import BodyReader
from freetoken.api.engine_client import EngineClient
from freetoken.protocol.parse import ParsedRequest


def _sampling_dict(params) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    if isinstance(out.get("logit_bias"), dict):
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


def _stream_options(parsed: ParsedRequest) -> dict | None:
    opts = getattr(parsed.request, "stream_options", None)
    return opts.model_dump() if opts is not None else None


def load_report(engine: EngineClient) -> dict[str, Any]:
    """One rank's numbers from engine.stats(): the source of /get_load and /loads."""
    s = engine.stats()
    block_size = engine.config.block_size
    running = s["num_running"]
    waiting = s["num_waiting"]
    used_blocks = s["kv_blocks_used"]
    total_blocks = s["kv_blocks_total"]
    queries = s["prefix_queries"]
    hits = s["prefix_hits"]
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


class ScaleOut:
    """The routes above over one engine; a render reads its body with the generation routes'
    reader, so it is validated exactly as the generation request would be."""

    def __init__(self, engine: EngineClient, reader: BodyReader):
        self.engine = engine
        self.reader = reader

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions/render", self.completions_render, methods=["POST"]),
            Route("/v1/chat/completions/render", self.chat_render, methods=["POST"]),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/loads", self.loads, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
        ]

    async def completions_render(self, request: Request) -> Response:
        parsed = self.reader.parse_generation(await self.reader.read_json(request), chat=False)
        rid = "cmpl-" + uuid.uuid4().hex
        sampling = _sampling_dict(parsed.params)
        out = []
        for i, prompt in enumerate(parsed.prompts):
            text = prompt.text
            if text is None:
                text = self.reader.tokenizer.decode(prompt.ids, skip_special_tokens=False)
            out.append(
                {
                    "request_id": f"{rid}-{i}",
                    "prompt": text,
                    "prompt_token_ids": list(prompt.ids),
                    "token_ids": list(prompt.ids),
                    "model": self.reader.served_model_name,
                    "sampling_params": sampling,
                    "stream": parsed.stream,
                    "stream_options": _stream_options(parsed),
                }
            )
        return JSONResponse(out)

    async def chat_render(self, request: Request) -> Response:
        parsed = self.reader.parse_generation(await self.reader.read_json(request), chat=True)
        return JSONResponse(
            {
                "request_id": "chatcmpl-" + uuid.uuid4().hex,
                "token_ids": list(parsed.prompts[0].ids),
                "model": self.reader.served_model_name,
                "sampling_params": _sampling_dict(parsed.params),
                "stream": parsed.stream,
                "stream_options": _stream_options(parsed),
            }
        )

    async def get_load(self, request: Request) -> Response:
        r = load_report(self.engine)
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
        return JSONResponse({"timestamp": time.time(), "loads": [load_report(self.engine)]})
