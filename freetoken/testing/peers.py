"""The systems scripts/compare_peers.py compares, each run as its own docs run it: a program,
its arguments, its environment (no thread-tuning variable leaked from the benchmark's shell) and
the command line that starts it as a server; and what a running server costs in memory (its peak
RSS, read from /proc).

What it is not: the runs themselves or their report (scripts/compare_peers.py, peer_report.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

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
        # the int8 compute mode (issue 24): x quantized to int8, integer dot products
        System("freetoken-int8", "freetoken", "freetoken-int8", ("--compute", "int8"), PASSIVE),
        System("llama-server-t1", "llama-server", "llama-server", ("-t", "1", "-tb", "1")),
        System(f"llama-server-t{t}", "llama-server", "llama-server", ("-t", t, "-tb", t)),
        # shown, never the table's figure: PASSIVE turns each of ggml's per-node OpenMP
        # barriers into a futex sleep and wake-up
        System(f"llama-server-t{t}-passive", "llama-server", None, ("-t", t, "-tb", t),
               PASSIVE),
        System("transformers", "transformers", "transformers"),
        System("transformers-passive", "transformers", "transformers", (), PASSIVE),
    ]


TRANSFORMERS_SKIP = ("the file is scripts/make_gguf.py's synthetic one: transformers would "
                     "dequantize every tensor to fp32 on load (at 8B ~30 GB, more than this "
                     "machine has) to score random blocks whose logits mean nothing")


def model_info(gguf: str, default_gguf: str) -> dict:
    """What a run serves: the file's general.name and size, whether it is a synthetic file of
    scripts/make_gguf.py (its general.name starts "synthetic ") and whether it is the default
    model `default_gguf` (the SmolLM2 whose table and README figures only its own runs write)."""
    from gguf import GGUFReader
    field = GGUFReader(gguf).fields.get("general.name")
    name = field.contents() if field is not None else None
    default = os.path.exists(default_gguf) and os.path.samefile(gguf, default_gguf)
    return {"name": name, "file_bytes": os.path.getsize(gguf), "default": default,
            "synthetic": bool(name and name.startswith("synthetic "))}


def skip_reason(system: System, model: dict) -> str | None:
    """Why `system` is not run on `model` (model_info's), or None."""
    return TRANSFORMERS_SKIP if system.kind == "transformers" and model["synthetic"] else None


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


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------

def vmhwm_kib(status_text: str) -> int | None:
    """VmHWM (the peak resident set, kB) of a /proc/<pid>/status text; None without one (a
    zombie, or a kernel thread)."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def descendants(pid: int, proc: str | os.PathLike = "/proc") -> list[int]:
    """The pids of every live process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path(proc).iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def peak_rss_mib(pid: int, proc: str | os.PathLike = "/proc") -> float | None:
    """The server's peak resident memory in MiB: VmHWM of `pid` plus that of each live
    descendant (None when `pid`'s cannot be read). Read it just before the server stops.

    NOTE: with children the sum of the peaks is an upper bound (they need not peak at once).
    A child that exited before the read is not counted: its memory is no longer the server's."""
    total = 0
    for i, p in enumerate([pid, *descendants(pid, proc)]):
        try:
            kib = vmhwm_kib((Path(proc) / str(p) / "status").read_text())
        except OSError:
            kib = None
        if kib is None and i == 0:
            return None
        total += kib or 0
    return round(total / 1024, 1)
