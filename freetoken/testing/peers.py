"""The systems scripts/compare_peers.py compares, each run as its own docs run it: a program,
its arguments, its environment (no thread-tuning variable leaked from the benchmark's shell) and
the command line that starts it as a server.

What it is not: the runs themselves or their report (scripts/compare_peers.py, peer_report.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# The variables through which an environment tunes a program's OpenMP / MKL threads. A peer runs
# with none of them, as its own docs run it: the benchmark's shell (scripts/test exports
# OMP_WAIT_POLICY, for one) must not leak into it.
THREAD_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")


def default_env() -> dict[str, str]:
    """This process's environment without any thread-tuning variable."""
    return {k: v for k, v in os.environ.items() if not k.startswith(THREAD_ENV_PREFIXES)}


@dataclass(frozen=True)
class System:
    """One row of the comparison: a program, its arguments and its environment.

    `column` is the table column the row competes for (the best row of a column is the figure
    the README shows); None for a row that is only shown (the PASSIVE llama-server)."""
    name: str
    kind: str  # "freetoken" | "llama-server" | "transformers"
    column: str | None
    args: tuple[str, ...] = ()
    env_set: tuple[tuple[str, str], ...] = ()

    def env(self) -> dict[str, str]:
        env = default_env()
        env.update(self.env_set)
        return env


PASSIVE = (("OMP_WAIT_POLICY", "PASSIVE"),)


def systems_for(threads: int) -> list[System]:
    """Every system the comparison knows, `threads` being the machine's core count."""
    t = str(threads)
    return [
        # what scripts/serve gives FreeToken: its own pool never waits in an OpenMP barrier,
        # and PASSIVE keeps torch's OpenMP threads from spinning between small ops
        System("freetoken-fp32", "freetoken", "freetoken-fp32", (), PASSIVE),
        System("freetoken-bf16", "freetoken", "freetoken-bf16", ("--dtype", "bfloat16"),
               PASSIVE),
        System("llama-server-t1", "llama-server", "llama-server", ("-t", "1", "-tb", "1")),
        System(f"llama-server-t{t}", "llama-server", "llama-server", ("-t", t, "-tb", t)),
        # shown, never the table's figure: PASSIVE turns each of ggml's per-node OpenMP
        # barriers into a futex sleep and wake-up
        System(f"llama-server-t{t}-passive", "llama-server", None, ("-t", t, "-tb", t),
               PASSIVE),
        System("transformers", "transformers", "transformers"),
        System("transformers-passive", "transformers", "transformers", (), PASSIVE),
    ]


def server_command(system: System, gguf: str, port: int, llama_exe: str | None,
                   llama_ctx: int) -> list[str]:
    """The command line that starts `system` as a server on `port`."""
    if system.kind == "freetoken":
        return [sys.executable, "-m", "freetoken", "--model", gguf, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", *system.args]
    if system.kind == "llama-server":
        if llama_exe is None:
            raise ValueError("llama-server is not built")
        # -np 8: the workloads keep 8 requests in flight; -c: 8 slots of llama_ctx / 8 tokens
        return [llama_exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                *system.args, "-np", "8", "-c", str(llama_ctx), "--no-webui"]
    raise ValueError(f"{system.name} is not a server")
