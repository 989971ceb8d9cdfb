"""`python -m freetoken`: the CLI. Flags -> ServerConfig, EngineConfig, KernelConfig -> Engine ->
app -> uvicorn.Server.

The parser is built from the config dataclasses (freetoken/config.py): one flag per field, its
default, help, parser and choices taken from the field, so no default is written here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from freetoken.config import EngineConfig, KernelConfig, ServerConfig

CONFIGS = (ServerConfig, EngineConfig, KernelConfig)
_GROUPS = {
    ServerConfig: "server",
    EngineConfig: "engine",
    KernelConfig: "kernels (process-wide; each variable named is only the default)",
}


def split_list(values: list[str] | None) -> list[str]:
    """Repeated flags and comma lists, flattened: ["a,b", "c"] -> ["a", "b", "c"]."""
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return _flag(f)[2:].replace("-", "_")


def _is_list(f: dataclasses.Field) -> bool:
    return f.default_factory is list


def _cli_default(f: dataclasses.Field) -> Any:
    """The field's default as the parser holds it: the env variable's text where one is set (the
    parser converts it like a flag's value), else the default, as text where the field shows
    it so (512MiB)."""
    meta = f.metadata
    text = os.environ.get(meta["env"], "").strip() if meta["env"] else ""
    if text:
        return text.lower() if meta["choices"] else text
    if meta["show"] is not None:
        return meta["show"](f.default)
    return f.default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m freetoken",
        description="FreeToken: a one-process, OpenAI-compatible inference server. Serves "
        "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
        "/tokenizer_info, /health, /metrics, /version and /openapi.json.",
        formatter_class=_Formatter,
    )
    for cls in CONFIGS:
        group = p.add_argument_group(_GROUPS[cls])
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if isinstance(f.default, bool):  # a switch to the other value
                group.add_argument(_flag(f), action="store_true", help=meta["help"])
            elif _is_list(f):  # NOTE: its env variable is read later, never shown as a default
                group.add_argument(_flag(f), action="append", default=None, help=meta["help"])
            else:
                parse = meta["parse"] or type(f.default)
                help_ = meta["help"] + (f"; ${meta['env']} sets the default" if meta["env"] else "")
                group.add_argument(_flag(f), type=parse, default=_cli_default(f),
                                   choices=meta["choices"], help=help_)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig, KernelConfig]:
    """The parsed flags as the three configs (their checks raise ValueError)."""

    def build(cls):
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, _dest(f))
            if isinstance(f.default, bool):
                value = (not f.default) if value else f.default
            elif _is_list(f):
                env = f.metadata["env"]
                value = split_list(value) or split_list([os.environ.get(env, "")] if env else [])
            values[f.name] = value
        return cls(**values)

    return build(ServerConfig), build(EngineConfig), build(KernelConfig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # NOTE: before torch is imported. Spinning OpenMP threads make small matmuls up to 100x
    # slower on a shared CPU (measured: 16.9 vs 2.4 decode tok/s, engine/generate.py); an explicit
    # OMP_WAIT_POLICY from the user wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        server_config, config, kernels = configs_from_args(args)
    except ValueError as exc:
        print(f"freetoken: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("freetoken")

    import torch
    import uvicorn

    from freetoken import ops
    from freetoken.api import create_app
    from freetoken.api.loading import LoadingServer
    from freetoken.engine import Engine
    from freetoken.loader import default_model_path, load_model

    try:  # before the model loads: the linear layers are packed for the kernels chosen here
        ops.configure(
            backend=kernels.kernels,
            linear=kernels.linear,
            cpu_isa=kernels.cpu_isa,
            pool_poll_us=kernels.pool_poll_us,
            compute=kernels.compute,
        )
    except ValueError as exc:
        print(f"freetoken: {exc}", file=sys.stderr)
        return 2
    sc = server_config
    path = Path(sc.model) if sc.model else default_model_path()
    name = sc.served_model_name or path.name.removesuffix(".gguf")
    if not path.exists():
        print(f"freetoken: --model {path}: no such file or directory", file=sys.stderr)
        return 2
    # /health (and every route) answers 503 while the model loads, not a refused connection.
    placeholder = LoadingServer(sc.host, sc.port).start()
    try:
        # NOTE: a KV pool set in blocks is sized once the model's shape is known; by bytes it
        # counts beside the weights, checked before any weight is read.
        loaded = load_model(path, dtype=config.torch_dtype, device=config.device,
                            kv_bytes=config.kv_cache_memory if config.num_kv_blocks is None else 0)
        engine = Engine(config, loaded)
    except (ValueError, RuntimeError, OSError, MemoryError) as exc:  # a bad file, device, budget
        placeholder.stop()
        print(f"freetoken: cannot serve {path}: {exc}", file=sys.stderr)
        return 2
    engine.start()
    try:
        backend = ops.backend()
    except Exception as exc:  # noqa: BLE001 -- informational only
        backend = f"unknown ({exc})"
    stats = engine.stats() or {}
    blocks = int(stats.get("kv_blocks_total", 0))
    kv = getattr(engine, "kv", None)
    pool = [*kv.k, *kv.v, kv.hidden, kv.hidden_valid] if kv else []
    kv_bytes = sum(t.numel() * t.element_size() for t in pool)
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
    app = create_app(
        engine,
        served_model_name=name,
        api_key=sc.api_keys,  # NOTE: never logged; only their number is
        max_batch_prompts=sc.max_batch_prompts,
        max_body_bytes=sc.max_body_bytes,
        request_timeout_s=sc.request_timeout_s or None,
        allowed_origins=sc.allowed_origins,
        stream_max_unread=sc.stream_max_unread,
        stream_send_timeout_s=sc.stream_send_timeout_s or None,
    )
    log.info(
        "limits: max_queue_len=%d request_timeout=%s max_body_bytes=%d shutdown_grace=%gs "
        "api keys=%d cors=%s",
        config.max_queue_len,
        f"{sc.request_timeout_s:g}s" if sc.request_timeout_s else "off",
        sc.max_body_bytes,
        sc.shutdown_grace_s,
        len(sc.api_keys),
        ",".join(sc.allowed_origins) or "off",
    )
    loop, http = _event_loop_and_http()
    log.info("http: uvicorn on %s:%d, event loop %s, HTTP parser %s", sc.host, sc.port, loop,
             http)
    server = _make_server_class()(
        uvicorn.Config(
            app,
            host=sc.host,
            port=sc.port,
            loop=loop,
            http=http,
            log_level=sc.log_level,
            access_log=False,
            timeout_graceful_shutdown=sc.shutdown_grace_s,
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
