"""The tables, bounds and plot of scripts/compare_peers.py, from its records.

A record is one bench_serve run (or one transformers mode) of one system on one workload:
`system` names its row, `column` the table column it competes for (None: a row that is only
shown). A column's figure is its best row's median over reps. Bounds are stated against the work
each system actually does: classify against the fp32 FLOPs of the tokens FreeToken computed,
decode against the bytes each system reads per step (its weights as its decode steps read them,
and the KV) and against the fp32 FLOPs of a token; the bound is the lower of the two. Every
server run also carries its peak RSS and its time to ready: per row, and per system over all its
runs against llama-server's.

NOTE: over the ~400 lines of STYLE.md: the table, the ratio rows, the bounds text and the plot
all read the same medians and best rows, and split apart they would pass them around.
"""

from __future__ import annotations

import json
import os
import statistics

STREAMS = {"decode": 8, "decode-1": 1}
REF = "freetoken-fp32"
INT8 = "freetoken-int8"
PEER = "llama-server"  # the column every ratio is taken against


def metric(wl: str) -> str:
    return "requests_per_s" if wl.startswith("classify") else "output_tokens_per_s"


def medians(recs: list[dict]) -> dict:
    """{(workload, system): the medians over reps and every rep's figure}."""
    groups: dict = {}
    for r in recs:
        groups.setdefault((r["workload"], r["system"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        def med(k):
            xs = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and r[k] == r[k]]
            return statistics.median(xs) if xs else None
        out[key] = {"column": rs[0].get("column"), "runs": len(rs),
                    "requests_per_s": med("requests_per_s"),
                    "output_tokens_per_s": med("output_tokens_per_s"),
                    "latency_p50_s": med("latency_p50_s"), "latency_p99_s": med("latency_p99_s"),
                    "ttft_p50_s": med("ttft_p50_s"), "ready_s": med("ready_s"),
                    "peak_rss_mib": med("peak_rss_mib"),
                    "cached_tokens_frac": med("cached_tokens_frac"),
                    "errors": sum(r.get("errors", 0) for r in rs),
                    "loadavg": [r["loadavg_before"][0] for r in rs],
                    "per_rep": [r[metric(key[0])] for r in rs]}
    return out


def best(med: dict) -> dict:
    """{(workload, column): (system, its medians)}: each column's best row per workload."""
    out: dict = {}
    for (wl, name), m in med.items():
        col, v = m["column"], m[metric(wl)]
        if col is None or v is None:
            continue
        if (wl, col) not in out or v > out[(wl, col)][1][metric(wl)]:
            out[(wl, col)] = (name, m)
    return out


# ---------------------------------------------------------------------------------------------
# bounds
# ---------------------------------------------------------------------------------------------

def bytes_key(system: str) -> str | None:
    """The key of compute_bound.py's decode bytes that `system` reads."""
    if system.startswith("llama-server"):
        return "llama-server"
    return system if system in ("freetoken-fp32", "freetoken-bf16", "freetoken-int8") else None


def machine_of(bounds: dict) -> dict:
    """The machine figures of compute_bound.py's full measurement (after the runs)."""
    return {"gemm_gflops": bounds["gemm_gflops_peak_fp32"],
            "read_gb_s": bounds["bandwidth"]["read_gb_s"]}


def classify_bound(bounds: dict, machine: dict) -> float:
    """fp32 compute bound in requests/s: GEMM peak / the FLOPs of the tokens computed."""
    return machine["gemm_gflops"] / bounds["classify"]["gflop_per_request"]


def decode_bound(bounds: dict, system: str, streams: int, machine: dict) -> dict:
    """{"bandwidth": streams x bandwidth / bytes read per step, "compute": GEMM peak / fp32
    FLOPs per token (FreeToken fp32 only: its arithmetic is fp32 FMAs), "bound": the lower,
    "step_bytes"} in tokens/s."""
    d = bounds["decode"]
    b = d["bytes"][bytes_key(system)]
    step_bytes = b["weights"] + streams * d["context_mean"] * b["kv_per_token"]
    out = {"bandwidth": streams * machine["read_gb_s"] * 1e9 / step_bytes,
           "step_bytes": step_bytes}
    if system == REF:
        out["compute"] = machine["gemm_gflops"] * 1e9 / d["flops_per_token"]
    out["bound"] = min(out["bandwidth"], out.get("compute", float("inf")))
    return out


def rep_bound_ratios(recs: list[dict], bounds: dict, wl: str, part: str = "bound"
                     ) -> tuple[float, list[float]] | None:
    """(median over reps of FreeToken fp32's value / that rep's bound, the reps' bounds) on
    `wl`, each bound from the machine measured right before the rep. `part`: for decode,
    "bandwidth", "compute" or "bound" (the lower)."""
    def bound(m):
        if wl.startswith("classify"):
            return classify_bound(bounds, m)
        return decode_bound(bounds, REF, STREAMS[wl], m)[part]
    pairs = [(r[metric(wl)], bound(r["machine"])) for r in recs
             if r.get("system") == REF and r.get("workload") == wl
             and r.get("machine") and r.get(metric(wl))]
    if not pairs:
        return None
    return statistics.median(v / b for v, b in pairs), [b for _, b in pairs]


# ---------------------------------------------------------------------------------------------
# drift
# ---------------------------------------------------------------------------------------------

def drift(resdir: str) -> dict:
    """Classify top-1 logprob drift of each dumped system against FreeToken fp32 (the same
    requests): {system: {requests, top1_agreement, max/mean_abs_logprob_diff}}."""
    def load(name):
        p = os.path.join(resdir, f"dump-{name}-classify.jsonl")
        return [json.loads(x) for x in open(p) if x.strip()] if os.path.exists(p) else None
    base = load(REF)
    out: dict = {}
    if not base:
        return out
    others = sorted(f[len("dump-"):-len("-classify.jsonl")] for f in os.listdir(resdir)
                    if f.startswith("dump-") and f.endswith("-classify.jsonl"))
    for name in others:
        other = load(name)
        if name == REF or not other:
            continue
        diffs, agree, n = [], 0, 0
        for a, b in zip(base, other):
            if not (a.get("top") and b.get("top")):
                continue
            n += 1
            ta, tb = max(a["top"], key=a["top"].get), max(b["top"], key=b["top"].get)
            agree += ta == tb
            if ta in b["top"]:
                diffs.append(abs(a["top"][ta] - b["top"][ta]))
        if n:
            out[name] = {"requests": n, "top1_agreement": agree / n,
                         "max_abs_logprob_diff": max(diffs) if diffs else None,
                         "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None}
    return out


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------

def model_title(meta: dict) -> str:
    """The model a run served, for headings: "Llama-3.2-1B-shaped Q4_K_M (synthetic)" for a
    file of scripts/make_gguf.py (its general.name "synthetic <shape> <mix>"), else its file."""
    name = (meta.get("model") or {}).get("name") or ""
    if name.startswith("synthetic "):
        shape, mix = name.split()[1:3]
        words = shape.split("-")
        words = [words[0].capitalize(), *words[1:-1], words[-1].upper()]
        return f"{'-'.join(words)}-shaped {mix.upper()} (synthetic)"
    return meta.get("gguf", "the model")


def _f(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


COLUMNS = [("freetoken-fp32", "FreeToken, fp32 compute"),
           ("freetoken-bf16", "FreeToken, bf16 compute"),
           ("freetoken-int8", "FreeToken, int8 compute"),
           ("llama-server", "llama-server, best of -t 1 / -t 2"),
           ("transformers-naive", "transformers"),
           ("transformers-prefix", "transformers, prefix KV reused")]
WORKLOAD_LABELS = [("classify", "classify, req/s"),
                   ("classify-multi", "classify, 16 prefixes, req/s"),
                   ("decode", "decode, 8 streams, tok/s"), ("decode-1", "decode, 1 stream, tok/s")]


class Report:
    def __init__(self, recs: list[dict], bounds: dict | None, drift_: dict, meta: dict,
                 took_s: float):
        self.recs, self.bounds, self.drift, self.meta = recs, bounds, drift_, meta
        self.took_s = took_s
        self.med = medians(recs)
        self.best = best(self.med)

    def peer(self, wl: str) -> float | None:
        b = self.best.get((wl, PEER))
        return b[1][metric(wl)] if b else None

    def render(self, workloads: list[str], plot: str = "benchmarks.png") -> str:
        """The run's tables in markdown; `plot`: the plot's path from where the text goes."""
        m = self.meta
        lines = [f"Run {m['started']} of `{m.get('commit')}` on `{m.get('gguf')}`, "
                 f"{self.took_s / 60:.1f} min, "
                 f"{m['reps']} interleaved reps, every server started fresh for every run. "
                 "FreeToken runs with `OMP_WAIT_POLICY=PASSIVE` (what `scripts/serve` sets); "
                 "llama-server and transformers with their default environment (no `OMP_*` or "
                 "`MKL_*` variable), except the rows ending in `-passive`. Medians over reps; "
                 "the load average (1 min) was read before each run. A peer's ratio column is "
                 "against the best llama-server row of the workload.", ""]
        lines += ["| workload | system | req/s | output tok/s | p50 latency s | p99 latency s | "
                  "TTFT p50 s | cached prompt | ready in s | peak RSS MiB | vs llama-server | "
                  "per rep | load avg before runs |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for wl in [w for w in workloads if any(k[0] == w for k in self.med)]:
            ref = self.peer(wl)
            for (w, name), s in sorted(self.med.items()):
                if w != wl:
                    continue
                v = s[metric(wl)]
                cached = s["cached_tokens_frac"]
                lines.append(
                    f"| {wl} | {name} | {_f(s['requests_per_s'])} | "
                    f"{_f(s['output_tokens_per_s'], 1)} | {_f(s['latency_p50_s'], 3)} | "
                    f"{_f(s['latency_p99_s'], 3)} | {_f(s['ttft_p50_s'], 3)} | "
                    f"{'–' if cached is None else f'{100 * cached:.0f} %'} | "
                    f"{_f(s['ready_s'], 1)} | {_f(s['peak_rss_mib'], 0)} | "
                    f"{f'{v / ref:.2f}x' if ref and v else '–'} | "
                    f"{', '.join(f'{x:.1f}' for x in s['per_rep'])} | "
                    f"{', '.join(f'{x:.2f}' for x in s['loadavg'])} |")
        lines.append("")
        lines += self.memory_lines()
        rows = self.ratio_rows(workloads)
        if rows:
            lines += ["| workload | ratio | value |", "|---|---|---:|"]
            lines += [f"| {a} | {b} | {c:.2f} |" for a, b, c in rows]
            lines.append("")
        if self.bounds:
            lines.append(self.bounds_text())
            lines.append("")
        if self.drift:
            lines += ["Classify logprob drift against FreeToken fp32 (the same requests; top-1 "
                      "token's logprob):", "",
                      "| system | requests | top-1 agreement | max abs diff | mean abs diff |",
                      "|---|---:|---:|---:|---:|"]
            for name, d in self.drift.items():
                lines.append(f"| {name} | {d['requests']} | {100 * d['top1_agreement']:.1f} % | "
                             f"{_f(d['max_abs_logprob_diff'], 5)} | "
                             f"{_f(d['mean_abs_logprob_diff'], 5)} |")
            lines.append("")
        lines.append(f"![requests/s and tokens/s per system]({plot})")
        return "\n".join(lines)

    def memory(self) -> dict:
        """{system: {"runs", "peak_rss_mib" (median over every run), "peak_rss_max_mib",
        "ready_s" (median)}} of each server, and "llama-server": every run of its column's
        rows together (memory and start do not depend on its thread count), when there are
        two or more such rows."""
        groups: dict = {}
        for r in self.recs:
            if r.get("peak_rss_mib") is not None or r.get("ready_s") is not None:
                groups.setdefault(r["system"], []).append(r)
        peers = [r for rs in groups.values() for r in rs if rs[0].get("column") == PEER]
        if len({r["system"] for r in peers}) > 1:
            groups[PEER] = peers
        out = {}
        for name, rs in groups.items():
            rss = [r["peak_rss_mib"] for r in rs if r.get("peak_rss_mib") is not None]
            ready = [r["ready_s"] for r in rs if r.get("ready_s") is not None]
            out[name] = {"runs": len(rs), "column": rs[0].get("column"),
                         "peak_rss_mib": statistics.median(rss) if rss else None,
                         "peak_rss_max_mib": max(rss) if rss else None,
                         "ready_s": statistics.median(ready) if ready else None}
        return out

    def memory_lines(self) -> list[str]:
        """The memory and start table: per system, over all its runs (every workload)."""
        mem = self.memory()
        lines = []
        if any(v["peak_rss_mib"] is not None for v in mem.values()):
            peer = mem.get(PEER) or next((v for v in mem.values() if v["column"] == PEER), {})
            lines += ["Peak RSS (VmHWM of the server process and any child, read just before it "
                      "stopped) and time to ready (start to the first 200 from /health), per "
                      "system over all its runs; a `llama-server` row pools its thread counts' "
                      "rows.", "",
                      "| system | runs | peak RSS MiB, median | max | ready in s, median | "
                      "RSS vs llama-server | ready vs llama-server |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for name, v in sorted(mem.items()):
                rss_x = _ratio(v["peak_rss_mib"], peer.get("peak_rss_mib"))
                ready_x = _ratio(v["ready_s"], peer.get("ready_s"))
                lines.append(f"| {name} | {v['runs']} | {_f(v['peak_rss_mib'], 0)} | "
                             f"{_f(v['peak_rss_max_mib'], 0)} | {_f(v['ready_s'], 1)} | "
                             f"{rss_x} | {ready_x} |")
            lines.append("")
        for name, why in (self.meta.get("skipped") or {}).items():
            lines.append(f"Not run: `{name}`, {why}")
        for f in self.meta.get("failed") or []:
            lines.append(f"Did not start: `{f['system']}` ({f['workload']}, rep {f['rep']}): "
                         f"{f['reason']}")
        if self.meta.get("skipped") or self.meta.get("failed"):
            lines.append("")
        return lines

    def ratio_rows(self, workloads: list[str]) -> list[tuple[str, str, float]]:
        rows = []
        for wl in workloads:
            ours = self.best.get((wl, REF))
            if not ours:
                continue
            v = ours[1][metric(wl)]
            for col in (PEER, "transformers-naive", "transformers-prefix"):
                other = self.best.get((wl, col))
                if other and other[1][metric(wl)]:
                    rows.append((wl, f"FreeToken fp32 / {col} (best row: {other[0]})",
                                 v / other[1][metric(wl)]))
            passive = [(n, s) for (w, n), s in self.med.items()
                       if w == wl and n.startswith(PEER) and n.endswith("-passive")]
            for name, s in passive:
                default = self.med.get((wl, name[:-len("-passive")]))
                if default and default[metric(wl)] and s[metric(wl)]:
                    rows.append((wl, f"{name} / {name[:-len('-passive')]}: what "
                                 "OMP_WAIT_POLICY=PASSIVE does to llama-server",
                                 s[metric(wl)] / default[metric(wl)]))
            if self.bounds:
                rows += self.bound_rows(wl, v)
            rows += self.int8_rows(wl, v)
        return rows

    def int8_rows(self, wl: str, fp32_value: float) -> list[tuple[str, str, float]]:
        """The int8 mode against llama-server, the exact mode and its own bound."""
        ours = self.best.get((wl, INT8))
        if not ours or not ours[1][metric(wl)]:
            return []
        v, rows = ours[1][metric(wl)], []
        other = self.best.get((wl, PEER))
        if other and other[1][metric(wl)]:
            rows.append((wl, f"FreeToken int8 / {PEER} (best row: {other[0]})",
                         v / other[1][metric(wl)]))
        rows.append((wl, "FreeToken int8 / FreeToken fp32", v / fp32_value))
        b = self.bounds
        if not b:
            return rows
        if wl == "classify" and b.get("int8_gops_peak"):
            bound = b["int8_gops_peak"] / b["classify"]["gflop_per_request"]
            rows.append((wl, f"FreeToken int8 / int8 compute bound of the tokens it computed "
                         f"({bound:.1f} req/s: the machine's "
                         f"{b.get('int8_bound_loop') or 'vpdpbusd (AVX512-VNNI)'} rate, "
                         f"{b['int8_gops_peak']:.0f} GOP/s)", v / bound))
        elif wl in STREAMS and INT8 in b["decode"]["bytes"]:
            machine = self.best_read_machine()
            d = decode_bound(b, INT8, STREAMS[wl], machine)
            rows.append((wl, f"FreeToken int8 / bandwidth bound of the bytes it reads "
                         f"({d['step_bytes'] / 1e6:.0f} MB a step at the run's best read "
                         f"bandwidth, {machine['read_gb_s']:.1f} GB/s: {d['bandwidth']:.0f} "
                         "tok/s)", v / d["bandwidth"]))
        return rows

    def best_read_machine(self) -> dict:
        """The machine after the runs, with the best read bandwidth measured in the run (before
        each fp32 rep, and after). NOTE: the torch sum that measures it varies 35-76 GB/s from
        one process to the next here; a bound from a low reading let a one-stream ratio pass 1,
        and the int8 mode and llama-server, which read the same bytes, must be held to one
        figure."""
        machine = dict(machine_of(self.bounds))
        machine["read_gb_s"] = max([machine["read_gb_s"]] + [
            r["machine"]["read_gb_s"] for r in self.recs if r.get("machine")])
        return machine

    def bound_rows(self, wl: str, value: float) -> list[tuple[str, str, float]]:
        b, after = self.bounds, machine_of(self.bounds)
        if wl.startswith("classify"):
            if wl != "classify":
                return []
            per_rep = rep_bound_ratios(self.recs, b, wl)
            if per_rep:
                ratio, reps = per_rep
                return [(wl, "FreeToken fp32 / fp32 compute bound of the tokens it computed, "
                         "measured before each rep (" + ", ".join(f"{x:.1f}" for x in reps)
                         + " req/s; median of the reps' ratios)", ratio)]
            return [(wl, f"FreeToken fp32 / fp32 compute bound "
                     f"({classify_bound(b, after):.1f} req/s)", value / classify_bound(b, after))]
        streams, rows = STREAMS[wl], []
        d = decode_bound(b, REF, streams, after)
        for part, what in [("bound", "its bound, the lower of the two below"),
                           ("bandwidth", f"bandwidth bound of the bytes it reads "
                                         f"({d['step_bytes'] / 1e6:.0f} MB a step)"),
                           ("compute", "fp32 compute bound")]:
            per_rep = rep_bound_ratios(self.recs, b, wl, part)
            if per_rep:
                ratio, reps = per_rep
                rows.append((wl, f"FreeToken fp32 / {what}, measured before each rep ("
                             + ", ".join(f"{x:.0f}" for x in reps) + " tok/s)", ratio))
            else:
                rows.append((wl, f"FreeToken fp32 / {what} ({d[part]:.0f} tok/s)",
                             value / d[part]))
        best = self.best_read_machine()
        for col in ("freetoken-bf16", PEER):
            other = self.best.get((wl, col))
            if other and other[1][metric(wl)]:
                o = decode_bound(b, other[0], streams, best)
                rows.append((wl, f"{other[0]} / bandwidth bound of the bytes it reads "
                             f"({o['step_bytes'] / 1e6:.0f} MB a step at the run's best read "
                             f"bandwidth, {best['read_gb_s']:.1f} GB/s: {o['bandwidth']:.0f} "
                             "tok/s)", other[1][metric(wl)] / o["bandwidth"]))
        return rows

    def bounds_text(self) -> str:
        b = self.bounds
        g, bw, c, d = b["gemm_gflops"], b["bandwidth"], b["classify"], b["decode"]
        text = (f"Machine bounds (scripts/compute_bound.py, {b['threads']} threads, after the "
                f"runs): fp32 GEMM {b['gemm_gflops_peak_fp32']:.0f} GFLOP/s (best of "
                + ", ".join(f"{k} {lib} {v:.0f}" for k, x in g.items() for lib, v in x.items())
                + f"), read bandwidth {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} "
                f"GB/s. Classify computes {c['computed_tokens_per_request']:.1f} tokens per "
                f"request ({c['computed_tokens_source']}) = {c['gflop_per_request']:.2f} GFLOP "
                f"with the lm_head at one position. A decode token costs "
                f"{d['flops_per_token'] / 1e6:.0f} MFLOP at a mean context of "
                f"{d['context_mean']:.0f}; a decode step reads the weights as "
                + "; ".join(f"{k}: {v['weights_read_as']}, {v['weights'] / 1e6:.0f} MB + "
                            f"{v['kv_per_token'] / 1e3:.1f} kB of KV per token of context"
                            for k, v in d["bytes"].items()) + ".")
        now = [(r["workload"], r["machine"]) for r in self.recs if r.get("machine")]
        if now:
            text += (" Measured again right before each FreeToken fp32 run (the bounds of its "
                     "rows): " + "; ".join(f"{wl} {m['gemm_gflops']:.0f} GFLOP/s, "
                                           f"{m['read_gb_s']:.1f} GB/s" for wl, m in now) + ".")
        return text

    def readme_summary(self) -> str:
        """The README's headline table: one row per workload, one column per system."""
        cols = [c for c in COLUMNS if any(k[1] == c[0] for k in self.best)]
        lines = ["| workload | " + " | ".join(n for _, n in cols) + " |",
                 "|---|" + "---:|" * len(cols)]
        for wl, label in WORKLOAD_LABELS:
            ref, cells = self.peer(wl), []
            for col, _ in cols:
                b = self.best.get((wl, col))
                v = b[1][metric(wl)] if b else None
                if v is None:
                    cells.append("–")
                elif ref and col != PEER:
                    cells.append(f"{v:.1f} ({v / ref:.2f}x)")
                else:
                    cells.append(f"{v:.1f}")
            if any(c != "–" for c in cells):
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        m = self.meta
        lines += ["", f"Medians of {m['reps']} interleaved reps, every server started fresh for "
                  f"every run, same SmolLM2 Q4_1 GGUF, this 2-core machine, {m['started']}; "
                  "(x) = against llama-server's better thread count under its default "
                  "environment. FreeToken's fp32 compute is on the GGUF's weights dequantized "
                  "exactly. How, every row, and the raw runs: "
                  "[docs/benchmarks.md](docs/benchmarks.md).", "",
                  "![requests/s and tokens/s per system](docs/benchmarks.png)"]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        panels = [(wl, label) for wl, label in WORKLOAD_LABELS
                  if any(k[0] == wl for k in self.best)]
        colors = ["#1f77b4", "#6baed6", "#d62728", "#7f7f7f", "#bcbd22"]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.4),
                                 squeeze=False)
        for ax, (wl, title) in zip(axes[0], panels):
            items = [(label, self.best[(wl, col)][1][metric(wl)], colors[i])
                     for i, (col, label) in enumerate(COLUMNS) if (wl, col) in self.best]
            bars = ax.bar(range(len(items)), [v for _, v, _ in items],
                          color=[c for _, _, c in items])
            ax.set_xticks(range(len(items)), [n.replace(", ", ",\n", 1) for n, _, _ in items],
                          fontsize=7)
            ax.set_title(title, fontsize=10)
            for bar, (_, v, _) in zip(bars, items):
                ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}", ha="center",
                        va="bottom", fontsize=8)
            ax.margins(y=0.15)
        m = self.meta
        fig.suptitle(f"{model_title(m)}\n{m['threads']} cores, {m['cpu']}, "
                     f"median of {m['reps']} interleaved reps ({m['started']})", fontsize=10)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "–"
