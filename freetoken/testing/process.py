"""One server process for tests, benchmarks and the soak: `python -m freetoken` (or any command
that serves /health) on a free loopback port, its output in a log file, started and stopped.

What it is not: the in-process server (live.py runs the app in a uvicorn thread, no subprocess),
nor the cluster launcher (freetoken/cluster.py, whose port helper this module uses).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import freetoken
from freetoken.cluster import free_port

# The folder that holds the imported `freetoken`: `python -m freetoken` run there imports the same
# tree as the caller (a worktree on PYTHONPATH, not the editable install's checkout).
TREE = Path(freetoken.__file__).resolve().parents[1]


def health(url: str, timeout: float = 2.0) -> int:
    """The status of GET url/health; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return 0


class ServerProcess:
    """A server subprocess on 127.0.0.1:`port` (a free one unless given).

    `args` go to `python -m freetoken` after `--port`; `command` replaces the whole command line
    for another server (its port already in it). `env` is the whole environment (default: this
    process's). `cwd` is where it runs: `python -m` puts that folder first on sys.path, so it
    picks the freetoken tree (default: the caller's). With `new_session`, the server leads its
    own process group and stop() signals the group. A context manager, or start() / stop()."""

    def __init__(self, args=(), *, log_path: str | os.PathLike, port: int | None = None,
                 env: dict[str, str] | None = None, command: list[str] | None = None,
                 new_session: bool = False, cwd: str | os.PathLike = TREE):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = command or [sys.executable, "-m", "freetoken", "--port", str(self.port),
                                   *args]
        self.env = dict(os.environ if env is None else env)
        self.new_session = new_session
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self) -> ServerProcess:
        """Start the process and return at once (start() also waits for /health)."""
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env,
                                         start_new_session=self.new_session)
        self._t0 = time.monotonic()
        return self

    def start(self, timeout_s: float = 240) -> ServerProcess:
        """Start the process and wait until /health answers 200."""
        self.spawn()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 240) -> None:
        """Poll /health until 200; raises with the log's tail when the process exits first or
        the time runs out (the process is killed then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_tail()}")
            if health(self.url) == 200:
                self.ready_s = time.monotonic() - self._t0
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("server did not come up:\n" + self.log_tail())
            time.sleep(0.25)

    def send_signal(self, sig: int) -> None:
        if self.new_session:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.send_signal(signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
