"""`python -m freetoken.cluster`: N FreeToken replicas on loopback ports behind vllm-router.

    python -m freetoken.cluster --replicas 2 --port 8000 --policy cache_aware -- --max-num-seqs 32

Everything after `--` goes to every replica (`python -m freetoken ...`). Each replica and the
router run in their own process group (the router forks a child), so stopping the cluster --
Ctrl-C, SIGTERM, or `Cluster.stop()` -- stops every process it started, children included:
SIGTERM to each group, SIGKILL after `--stop-timeout` seconds. Every wait is bounded.

The router is vllm-router (`pip install vllm-router==0.1.17`, a Rust binary; it does not pull
torch). Policies: `cache_aware` (routes on the token ids our render endpoints return; see
docs/scale-out.md), `consistent_hash` (routes on the `X-Session-ID` header), `round_robin`,
`power_of_two`, `random`, ... -- whatever `vllm-router --policy` accepts.

The `Cluster` class is the same thing for tests and scripts:

    with Cluster(replicas=2, policy="cache_aware", replica_args=["--max-model-len", "512"]) as c:
        httpx.post(c.router_url + "/v1/completions", json=...)
        c.kill_replica(0)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_ROUTER_ARGS = (
    # The router drops a replica after one failed probe and takes it back after one good one;
    # probes every 2 s with a 2 s timeout, so a dead replica is marked unhealthy within ~4 s.
    "--health-check-interval-secs",
    "2",
    "--health-check-timeout-secs",
    "2",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    # A replica that stops answering trips its circuit breaker after two failed attempts; the
    # router's retry (5 attempts, 50 ms backoff, a fresh worker choice each time) then goes to
    # another replica, so a request caught by a crash is answered instead of failed. After 5 s
    # the breaker lets one request through to test the replica again.
    "--cb-failure-threshold",
    "2",
    "--cb-timeout-duration-secs",
    "5",
    "--request-timeout-secs",
    "300",
    "--worker-startup-timeout-secs",
    "60",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_command() -> list[str]:
    """The vllm-router launcher: its console script, else the module of the same package."""
    exe = shutil.which("vllm-router")
    if exe:
        return [exe]
    try:
        import vllm_router.launch_router  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "vllm-router is not installed: pip install vllm-router==0.1.17"
        ) from None
    return [sys.executable, "-m", "vllm_router.launch_router"]


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):
        return 0, b""


def _stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group `proc` leads (its own session), SIGKILL after `timeout` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(proc):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.05)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader if it exited, so a zombie does not count
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a group member we cannot signal
        return True
    return True


class Cluster:
    """N replicas + vllm-router, all on 127.0.0.1. See the module docstring."""

    def __init__(
        self,
        replicas: int = 2,
        *,
        policy: str = "cache_aware",
        port: int = 0,
        replica_ports: list[int] | None = None,
        replica_args: list[str] | tuple[str, ...] = (),
        router_args: list[str] | tuple[str, ...] = (),
        log_dir: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180.0,
        stop_timeout: float = 10.0,
        python: str = sys.executable,
    ):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.n = replicas
        self.policy = policy
        self.port = port or free_port()
        self.replica_ports = list(replica_ports or [free_port() for _ in range(replicas)])
        if len(self.replica_ports) != replicas:
            raise ValueError("one port per replica")
        self.replica_args = list(replica_args)
        self.router_args = list(router_args)
        self.log_dir = Path(log_dir) if log_dir else None
        self.env = dict(os.environ if env is None else env)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.python = python
        self.replicas: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self._logs: list = []

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports]

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _log(self, name: str):
        if self.log_dir is None:
            return subprocess.DEVNULL
        self.log_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 -- closed in stop()
        self._logs.append(f)
        return f

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = self._log(name)
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # its own process group: stop() signals the whole group
        )

    def start(self) -> Cluster:
        try:
            for i, port in enumerate(self.replica_ports):
                cmd = [self.python, "-m", "freetoken", "--host", "127.0.0.1", "--port", str(port)]
                self.replicas.append(self._spawn(cmd + self.replica_args, f"replica{i}"))
            deadline = time.monotonic() + self.startup_timeout
            for i, url in enumerate(self.replica_urls):
                self._wait(url + "/health", deadline, self.replicas[i], f"replica {i} ({url})")
            cmd = router_command() + [
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                self.policy,
                "--worker-urls",
                *self.replica_urls,
                *DEFAULT_ROUTER_ARGS,
            ]
            if "--prometheus-port" not in self.router_args:
                # its own metrics listener (default 29000) would collide with another router
                cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            cmd += self.router_args
            self.router = self._spawn(cmd, "router")
            self._wait(self.router_url + "/v1/models", deadline, self.router, "vllm-router")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, url: str, deadline: float, proc: subprocess.Popen, what: str) -> None:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode} during startup")
            status, _ = _get(url)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} was not ready within {self.startup_timeout:.0f} s")
            time.sleep(0.25)

    def kill_replica(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill replica i's process group (SIGKILL: no graceful drain, as a crash would)."""
        proc = self.replicas[i]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """Router first (no new traffic), then every replica. Idempotent."""
        if self.router is not None:
            _stop_group(self.router, self.stop_timeout)
        for proc in self.replicas:
            _stop_group(proc, self.stop_timeout)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m freetoken.cluster",
        description="Start N FreeToken replicas on loopback ports and vllm-router in front; "
        "Ctrl-C or SIGTERM stops them all. Arguments after `--` go to every replica.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=2, help="number of FreeToken replicas")
    p.add_argument("--port", type=int, default=8000, help="the router's port on 127.0.0.1")
    p.add_argument(
        "--replica-ports",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="comma-separated replica ports (default: free ports)",
    )
    p.add_argument(
        "--policy",
        default="cache_aware",
        help="vllm-router --policy: cache_aware, consistent_hash, round_robin, power_of_two, ...",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra vllm-router argument (repeatable), e.g. --router-arg=--cache-threshold "
        "--router-arg=0.5",
    )
    p.add_argument("--log-dir", default=None, help="write replicaN.log and router.log here")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to get ready")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="SIGTERM grace, seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    replica_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, replica_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    cluster = Cluster(
        args.replicas,
        policy=args.policy,
        port=args.port,
        replica_ports=args.replica_ports,
        replica_args=replica_args,
        router_args=args.router_arg,
        log_dir=args.log_dir,
        startup_timeout=args.startup_timeout,
        stop_timeout=args.stop_timeout,
    )
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        print(
            json.dumps(
                {
                    "router": cluster.router_url,
                    "policy": cluster.policy,
                    "replicas": cluster.replica_urls,
                }
            ),
            flush=True,
        )
        reported: set[int] = set()
        while True:
            if cluster.router is not None and cluster.router.poll() is not None:
                print("freetoken.cluster: the router exited; stopping", file=sys.stderr)
                return 1
            for i, proc in enumerate(cluster.replicas):
                if proc.poll() is not None and i not in reported:
                    reported.add(i)
                    print(
                        f"freetoken.cluster: replica {i} exited ({proc.returncode}); the "
                        "router's health check drops it",
                        file=sys.stderr,
                    )
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"freetoken.cluster: {exc}", file=sys.stderr)
        return 2
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
