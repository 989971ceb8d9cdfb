"""scripts/compare_peers.py's measurements and where they go, without a server or a model file:
the peak RSS read from a /proc tree (a fake one), the report's RSS and time-to-ready columns, the
bytes a decode step reads from a K-quant GGUF (a tiny one written here) and the docs sections a
model other than SmolLM2 writes. The runs themselves are tests/server/test_loadgen.py's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.testing import gguf_costs as cb
from freetoken.testing import gguf_files
from freetoken.testing import peer_docs as pd
from freetoken.testing import peer_report as pr
from freetoken.testing import peers as cp

STATUS = """Name:\tllama-server
Umask:\t0022
State:\tS (sleeping)
Pid:\t{pid}
PPid:\t{ppid}
VmPeak:\t 9000000 kB
VmSize:\t 8000000 kB
VmHWM:\t  {hwm} kB
VmRSS:\t  {rss} kB
Threads:\t3
"""


def fake_proc(root: Path, pid: int, ppid: int, comm: str, hwm: int | None) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
    status = STATUS.format(pid=pid, ppid=ppid, hwm=hwm, rss=(hwm or 0) // 2)
    if hwm is None:  # a zombie has no Vm* lines
        status = "\n".join(x for x in status.splitlines() if not x.startswith("Vm"))
    (d / "status").write_text(status)


def test_vmhwm_is_read_from_a_status_text():
    assert cp.vmhwm_kib(STATUS.format(pid=7, ppid=1, hwm=1536000, rss=1)) == 1536000
    assert cp.vmhwm_kib("Name:\tkworker/0:1\nState:\tI (idle)\n") is None


def test_peak_rss_sums_the_server_and_its_descendants(tmp_path):
    fake_proc(tmp_path, 100, 1, "python3", 1048576)           # the server: 1 GiB
    fake_proc(tmp_path, 101, 100, "worker (1) x", 524288)     # a child, ")" in its name
    fake_proc(tmp_path, 102, 101, "grandchild", 262144)       # its child
    fake_proc(tmp_path, 103, 100, "zombie", None)             # exited, not yet reaped
    fake_proc(tmp_path, 200, 1, "other", 99999999)            # not the server's
    (tmp_path / "self").mkdir()                               # not a process folder
    assert sorted(cp.descendants(100, tmp_path)) == [101, 102, 103]
    assert cp.peak_rss_mib(100, tmp_path) == pytest.approx(1792.0)
    assert cp.peak_rss_mib(102, tmp_path) == pytest.approx(256.0)
    assert cp.peak_rss_mib(103, tmp_path) is None
    assert cp.peak_rss_mib(999, tmp_path) is None
    assert cp.peak_rss_mib(os.getpid()) > 0  # this process, through the real /proc


def rec(system, column, wl, rep, value, rss, ready):
    key = "requests_per_s" if wl.startswith("classify") else "output_tokens_per_s"
    return {"workload": wl, "system": system, "column": column, "rep": rep, key: value,
            "loadavg_before": [1.0], "peak_rss_mib": rss, "ready_s": ready}


def test_the_table_shows_peak_rss_and_ready_per_row_and_per_system():
    recs = [rec("freetoken-fp32", "freetoken-fp32", "decode", 0, 300.0, 5000.0, 30.0),
            rec("freetoken-fp32", "freetoken-fp32", "decode", 1, 310.0, 5600.0, 32.0),
            rec("freetoken-fp32", "freetoken-fp32", "classify", 0, 9.0, 5200.0, 31.0),
            rec("llama-server-t1", "llama-server", "decode", 0, 100.0, 1400.0, 1.4),
            rec("llama-server-t2", "llama-server", "decode", 0, 200.0, 1600.0, 1.8),
            rec("llama-server-t2", "llama-server", "classify", 0, 4.0, 1500.0, 1.6)]
    meta = {"started": "now", "reps": 2, "threads": 2, "gguf": "x.gguf",
            "skipped": {"transformers": "it cannot"},
            "failed": [{"system": "freetoken-bf16", "workload": "decode", "rep": 0,
                        "reason": "MemoryError: x.gguf needs about 30 GiB"}]}
    report = pr.Report(recs, None, {}, meta, 60.0)
    # the speed's best rows are unchanged by the new columns
    assert report.best[("decode", "llama-server")][0] == "llama-server-t2"
    text = report.render(["classify", "decode"], plot="bench/x/benchmarks.png")
    header = next(x for x in text.splitlines() if x.startswith("| workload | system |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    row = next(x for x in text.splitlines() if x.startswith("| decode | freetoken-fp32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(cols)
    assert cells[cols.index("ready in s")] == "31.0"        # median of 30 and 32
    assert cells[cols.index("peak RSS MiB")] == "5300"      # median of 5000 and 5600
    mem = report.memory()
    assert mem["freetoken-fp32"] == {"runs": 3, "column": "freetoken-fp32",
                                     "peak_rss_mib": 5200.0, "peak_rss_max_mib": 5600.0,
                                     "ready_s": 31.0}
    # llama-server pools its column's rows, whatever the thread count
    assert mem["llama-server"]["peak_rss_mib"] == 1500.0
    assert mem["llama-server"]["ready_s"] == pytest.approx(1.6)
    row = next(x for x in text.splitlines() if x.startswith("| freetoken-fp32 | 3 |"))
    assert row == "| freetoken-fp32 | 3 | 5200 | 5600 | 31.0 | 3.47x | 19.38x |"
    # one llama-server row is its own pool: no second row for it
    one = pr.Report([r for r in recs if r["system"] != "llama-server-t1"], None, {}, meta, 60.0)
    assert "llama-server" not in one.memory()
    assert "| freetoken-fp32 | 3 | 5200 | 5600 | 31.0 | 3.35x | 18.24x |" in \
        one.render(["decode"])
    assert "Not run: `transformers`, it cannot" in text
    assert "Did not start: `freetoken-bf16` (decode, rep 0): MemoryError" in text
    assert text.endswith("![requests/s and tokens/s per system](bench/x/benchmarks.png)")


def test_the_int8_mode_and_llama_server_are_held_to_one_read_bandwidth():
    """Both read about the same bytes: their bandwidth bounds take the run's best read figure
    (here a rep's 60 GB/s, not the 30 measured after the runs), so neither looks nearer its
    bound than the other only because the machine read slower at one moment."""
    machine = {"gemm_gflops": 200.0, "read_gb_s": 60.0}
    recs = [dict(rec("freetoken-fp32", "freetoken-fp32", "decode-1", 0, 20.0, 900.0, 2.0),
                 machine=machine),
            rec("freetoken-int8", "freetoken-int8", "decode-1", 0, 45.0, 900.0, 2.0),
            rec("llama-server-t2", "llama-server", "decode-1", 0, 44.0, 900.0, 1.0)]
    weights = {"weights": 600e6, "kv_per_token": 0.0}
    bounds = {"gemm_gflops_peak_fp32": 200.0, "bandwidth": {"read_gb_s": 30.0},
              "decode": {"context_mean": 70.0, "flops_per_token": 2e9,
                         "bytes": {"freetoken-fp32": weights, "freetoken-int8": weights,
                                   "llama-server": weights}}}
    rows = {name: value for wl, name, value in
            pr.Report(recs, bounds, {}, {}, 1.0).ratio_rows(["decode-1"])}
    peer = next(v for k, v in rows.items() if k.startswith("llama-server-t2 / bandwidth"))
    ours = next(v for k, v in rows.items() if k.startswith("FreeToken int8 / bandwidth"))
    assert peer == pytest.approx(44.0 / 100.0) and ours == pytest.approx(45.0 / 100.0)
    assert all("60.0 GB/s" in k for k in rows if "/ bandwidth" in k and "fp32" not in k)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory) -> str:
    """A tiny Llama in Q4_K_M's layout (Q4_K; Q6_K for the output and for layer 1's attn_v and
    ffn_down), with a 256-token vocabulary of its own (no model file)."""
    d = tmp_path_factory.mktemp("gguf")
    vocab = d / "vocab.gguf"
    w = GGUFWriter(str(vocab), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(256)])
    w.add_tensor("x", np.zeros(1, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = d / "tiny.Q4_K_M.gguf"
    gguf_files.write(str(path), "tiny", "q4_k_m", tokenizer_from=str(vocab))
    return str(path)


def test_bytes_per_step_count_the_files_own_k_quant_blocks(tiny_q4_k_m):
    s = cb.model_shape(tiny_q4_k_m)
    h, f, kv, v = 256, 512, 128, 256  # tiny: hidden, ffn, kv heads x head dim, vocabulary

    def nbytes(qtype, rows, cols):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        return rows * cols // block * size

    layer = {0: nbytes("Q4_K", h, h) * 2 + nbytes("Q4_K", kv, h) * 2 + nbytes("Q4_K", f, h) * 2
             + nbytes("Q4_K", h, f),
             1: nbytes("Q4_K", h, h) * 2 + nbytes("Q4_K", kv, h) + nbytes("Q6_K", kv, h)
             + nbytes("Q4_K", f, h) * 2 + nbytes("Q6_K", h, f)}
    norms = 4 * h * 5  # two per layer and the final one, F32
    output = nbytes("Q6_K", v, h)  # untied: the embedding's one row is not counted
    assert s["gguf_step_bytes"] == layer[0] + layer[1] + norms + output
    assert s["gguf_weight_bytes"] == s["gguf_step_bytes"] + nbytes("Q4_K", v, h)
    assert s["gguf_type_bytes"]["Q6_K"] == nbytes("Q6_K", kv, h) + nbytes("Q6_K", h, f) + output
    # the classify FLOPs come from the file's shapes
    assert (s["layers"], s["hidden"], s["ffn"], s["vocab"]) == (2, h, f, v)
    assert s["linear_params_per_layer"] == 2 * h * h + 2 * kv * h + 3 * f * h
    # llama-server reads the file's blocks
    assert cb.decode_bytes(s, ())["llama-server"]["weights"] == s["gguf_step_bytes"]
    # FreeToken fp32 computes on the file's blocks whatever its size: its Q4_K and Q6_K matrices
    # as block panels (model/linear.py block_panel_types; 1.06x / 1.31x their bytes), layer 1's
    # q|k|v, fused from two types, in place
    from freetoken.model.linear import block_panel_bytes

    qkv1 = nbytes("Q4_K", h, h) + nbytes("Q4_K", kv, h) + nbytes("Q6_K", kv, h)
    repacked = (2 * block_panel_bytes("Q4_K", h, h) + 2 * block_panel_bytes("Q4_K", kv, h)
                + 4 * block_panel_bytes("Q4_K", f, h) + block_panel_bytes("Q4_K", h, f)
                + block_panel_bytes("Q4_K", h, h) + block_panel_bytes("Q6_K", h, f)
                + block_panel_bytes("Q6_K", v, h))
    for shape in (s, {**s, "params": (1 << 30) // 4 + 1}):  # SmolLM2-sized and over 1 GiB
        fp32 = cb.decode_bytes(shape, ("Q4_K", "Q6_K"))["freetoken-fp32"]
        assert fp32["weights"] == qkv1 + repacked + norms
        assert "Q4_K block panels" in fp32["weights_read_as"]
        assert "Q6_K block panels" in fp32["weights_read_as"]
    assert cb.decode_bytes(s, ("Q4_K", "Q6_K"))["llama-server"]["weights"] == \
        s["gguf_step_bytes"]
    # a small file of a type without block panels is dequantized at load: fp32 panels (4 bytes
    # a weight) but the norms
    q5 = str(Path(tiny_q4_k_m).parent / "tiny.Q5_K.gguf")
    gguf_files.write(q5, "tiny", "Q5_K", tokenizer_from=str(Path(tiny_q4_k_m).parent
                                                            / "vocab.gguf"))
    params = 2 * (2 * h * h + 2 * kv * h + 3 * f * h) + v * h
    fp32 = cb.decode_bytes(cb.model_shape(q5), ("Q4_1", "Q8_0"))["freetoken-fp32"]
    assert fp32["weights"] == 4 * params + norms
    assert "fp32 panels of Q5_K" in fp32["weights_read_as"]


def test_a_synthetic_model_gets_its_own_section_and_folder(tmp_path, tiny_q4_k_m):
    model = cp.model_info(tiny_q4_k_m, str(tmp_path / "absent.gguf"))
    assert model["synthetic"] and not model["default"]
    assert model["name"] == "synthetic tiny q4_k_m"
    transformers = next(s for s in cp.systems_for(2) if s.kind == "transformers")
    server = next(s for s in cp.systems_for(2) if s.kind == "llama-server")
    assert "synthetic" in cp.skip_reason(transformers, model)
    assert cp.skip_reason(server, model) is None
    assert cp.skip_reason(transformers, {**model, "synthetic": False}) is None

    meta = {"model": {"name": "synthetic llama-3.2-1b q4_k_m", "synthetic": True},
            "argv": ["scripts/compare_peers.py", "--model", "m.gguf"]}
    assert pr.model_title(meta) == "Llama-3.2-1B-shaped Q4_K_M (synthetic)"
    assert pr.model_title({"gguf": "SmolLM2.Q4_1.gguf", "model": {"name": "SmolLM2"}}) == \
        "SmolLM2.Q4_1.gguf"
    docs = tmp_path / "docs"
    dest = pd.destination(str(docs), "/m/llama-3.2-1b.Q4_K_M.gguf", False, meta)
    assert dest.raw_dir == str(docs / "bench" / "llama-3.2-1b.Q4_K_M")
    assert dest.plot_link == "bench/llama-3.2-1b.Q4_K_M/benchmarks.png" and not dest.readme
    assert dest.heading == "## At size: Llama-3.2-1B-shaped Q4_K_M (synthetic)"
    default = pd.destination(str(docs), "/m/SmolLM2.gguf", True, {})
    assert default.markers == pd.RESULTS_MARKERS and default.readme

    page = docs / "benchmarks.md"
    docs.mkdir()
    page.write_text("# B\n\n## Results\n\n<!-- results:begin -->\nsmol\n<!-- results:end -->\n"
                    "\n## History\n\nold\n")
    intro = pd.section_intro("llama-3.2-1b.Q4_K_M", meta)
    assert "random but valid blocks" in intro and "--model m.gguf" in intro
    pd.write_between(str(page), dest.markers, "run 1", dest.heading)
    pd.write_between(str(page), dest.markers, "run 2", dest.heading)
    text = page.read_text()
    assert text.count(dest.heading) == 1 and "run 1" not in text and "run 2" in text
    assert text.index("smol") < text.index(dest.heading) < text.index("## History")
    pd.write_between(str(page), default.markers, "smol 2")
    assert "smol 2" in page.read_text() and "run 2" in page.read_text()

    # the default's raw files are replaced, each other model's folder below them kept
    bench = docs / "bench"
    (bench / dest.raw_dir.rsplit("/", 1)[1]).mkdir(parents=True)
    (Path(dest.raw_dir) / "runs.jsonl").write_text("{}\n")
    (bench / "dump-old-classify.jsonl").write_text("{}\n")
    res = tmp_path / "res"
    res.mkdir()
    (res / "runs.jsonl").write_text("{}\n")
    (res / "meta.jsonl").write_text("{}\n")
    pd.keep_raw(str(res), str(bench))
    assert sorted(os.listdir(bench)) == ["llama-3.2-1b.Q4_K_M", "meta.jsonl", "runs.jsonl"]
    assert os.listdir(dest.raw_dir) == ["runs.jsonl"]
    assert pd.result_dirs(str(bench)) == [str(bench)]
    (Path(dest.raw_dir) / "meta.jsonl").write_text("{}\n")
    assert pd.result_dirs(str(bench)) == [str(bench), dest.raw_dir]
