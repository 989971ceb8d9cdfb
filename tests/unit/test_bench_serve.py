"""The benchmarks' shared parts (freetoken/testing/): the workload builders, the load
generator's stats math, and the bound ratios, best rows and environments of
scripts/compare_peers.py. One tiny run against a real server is tests/server/test_loadgen.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from freetoken.testing import loadgen as lg
from freetoken.testing import peer_report as pr
from freetoken.testing import peers as cp
from freetoken.testing import workloads as wl

ROOT = Path(__file__).resolve().parents[2]


def test_classify_workload_shape():
    reqs = wl.build_workload("classify")
    assert len(reqs) == 200
    assert all(r.prompt.startswith(wl.PREFIX) and r.prompt.endswith("\nSentiment:")
               for r in reqs)
    assert len({r.prompt for r in reqs}) == 200  # every review is unique
    assert all(r.max_tokens == 1 and r.classify for r in reqs)
    # deterministic: the same seed gives the same prompts, another seed other ones
    assert [r.prompt for r in wl.build_workload("classify")] == [r.prompt for r in reqs]
    assert wl.build_workload("classify", 5, seed=1)[0].prompt != reqs[0].prompt
    # the warm-up requests are never among the measured ones
    measured = {r.prompt for r in reqs}
    assert not measured & {w.prompt for w in wl.warmup_requests("classify", 3)}


def test_classify_multi_uses_16_distinct_prefixes():
    pre = wl.multi_prefixes()
    assert len(pre) == len(set(pre)) == 16
    reqs = wl.build_workload("classify-multi")
    assert len(reqs) == 200
    used = {r.tag for r in reqs}
    assert len(used) == 16
    for r in reqs:
        assert r.prompt.startswith(pre[int(r.tag[1:])])
    assert [r.tag for r in wl.build_workload("classify-multi")] == [r.tag for r in reqs]


def test_decode_workloads():
    d = wl.build_workload("decode")
    assert len(d) == 16 and len({r.prompt for r in d}) == 16
    assert all(r.max_tokens == 128 and not r.classify for r in d)
    assert wl.WORKLOADS["decode"][1] == 8 and wl.WORKLOADS["decode-1"][1] == 1
    assert wl.WORKLOADS["decode-4"][1] == 4
    assert [r.prompt for r in wl.build_workload("decode-4")] == [r.prompt for r in d[:8]]
    assert wl.build_workload("decode-1", 3, max_tokens=7)[2].max_tokens == 7
    with pytest.raises(ValueError):
        wl.build_workload("nope")


def test_payloads_per_flavor():
    c = wl.build_workload("classify", 1)[0]
    d = wl.build_workload("decode", 1)[0]
    pc = wl.payload(c, "openai", "m", stream=False)
    assert pc == {"prompt": c.prompt, "max_tokens": 1, "temperature": 0.0, "model": "m",
                  "logprobs": 2}
    pd = wl.payload(d, "openai", None, stream=True)
    assert pd["ignore_eos"] is True and pd["stream"] is True
    assert pd["stream_options"] == {"include_usage": True} and "model" not in pd
    assert "cache_prompt" not in pd  # FreeToken answers unknown fields with a 400
    assert wl.payload(d, "llama-server", None, stream=True)["cache_prompt"] is True


def test_bound_ratios_use_the_machine_measured_before_each_rep():
    """peer_report: a rep's bound is its machine's GEMM peak / GFLOP per request (classify), or
    the lower of streams x bandwidth / the bytes FreeToken fp32 reads a step and the GEMM peak /
    FLOPs per token (decode); the ratio is the median of the reps' value / bound; only
    FreeToken fp32's records of that workload count."""
    bounds = {"classify": {"gflop_per_request": 10.0},
              "decode": {"context_mean": 10.0, "flops_per_token": 1e9,
                         "bytes": {"freetoken-fp32": {"weights": 100e6, "kv_per_token": 1e6}}}}
    recs = [
        {"system": "freetoken-fp32", "workload": "classify", "requests_per_s": 30.0,
         "machine": {"gemm_gflops": 600.0, "read_gb_s": 40.0}},    # bound 60 -> 0.5
        {"system": "freetoken-fp32", "workload": "classify", "requests_per_s": 40.0,
         "machine": {"gemm_gflops": 300.0, "read_gb_s": 40.0}},    # bound 30 -> 1.33
        {"system": "freetoken-fp32", "workload": "classify", "requests_per_s": 36.0,
         "machine": {"gemm_gflops": 450.0, "read_gb_s": 10.0}},    # bound 45 -> 0.8
        {"system": "llama-server-t2", "workload": "classify", "requests_per_s": 9.0,
         "machine": {"gemm_gflops": 1.0, "read_gb_s": 1.0}},
        # 8 streams: 100 MB of weights + 8 x 10 x 1 MB of KV = 180 MB a step; 8 x 45e9 / 180e6
        # = 2000 tok/s bandwidth, 500e9 / 1e9 = 500 tok/s compute
        {"system": "freetoken-fp32", "workload": "decode", "output_tokens_per_s": 400.0,
         "machine": {"gemm_gflops": 500.0, "read_gb_s": 45.0}},
        # 1 stream: 110 MB a step, 11e9 / 110e6 = 100 tok/s bandwidth, 500 compute
        {"system": "freetoken-fp32", "workload": "decode-1", "output_tokens_per_s": 80.0,
         "machine": {"gemm_gflops": 500.0, "read_gb_s": 11.0}},
    ]
    ratio, reps = pr.rep_bound_ratios(recs, bounds, "classify")
    assert reps == pytest.approx([60.0, 30.0, 45.0])
    assert ratio == pytest.approx(0.8)
    assert pr.rep_bound_ratios(recs, bounds, "decode", "bandwidth") == \
        pytest.approx((0.2, [2000.0]))
    assert pr.rep_bound_ratios(recs, bounds, "decode", "compute") == pytest.approx((0.8, [500.0]))
    assert pr.rep_bound_ratios(recs, bounds, "decode") == pytest.approx((0.8, [500.0]))
    assert pr.rep_bound_ratios(recs, bounds, "decode-1") == pytest.approx((0.8, [100.0]))
    assert pr.rep_bound_ratios(recs, bounds, "classify-multi") is None


def test_a_column_shows_its_best_row_and_passive_rows_compete_for_none():
    recs = [{"workload": "decode", "system": s, "column": c, "output_tokens_per_s": v,
             "loadavg_before": [1.0]}
            for s, c, v in [("llama-server-t1", "llama-server", 120.0),
                            ("llama-server-t1", "llama-server", 126.0),
                            ("llama-server-t2", "llama-server", 140.0),
                            ("llama-server-t2", "llama-server", 150.0),
                            ("llama-server-t2-passive", None, 300.0),
                            ("freetoken-fp32", "freetoken-fp32", 600.0)]]
    best = pr.best(pr.medians(recs))
    assert best[("decode", "llama-server")][0] == "llama-server-t2"
    assert best[("decode", "llama-server")][1]["output_tokens_per_s"] == 145.0
    assert ("decode", None) not in best
    report = pr.Report(recs, None, {}, {"started": "now", "reps": 2, "threads": 2}, 60.0)
    rows = {b: c for a, b, c in report.ratio_rows(["decode"])}
    assert rows["FreeToken fp32 / llama-server (best row: llama-server-t2)"] == \
        pytest.approx(600 / 145)
    assert "(4.14x)" in report.readme_summary()


def test_the_int8_row_is_held_to_llama_server_fp32_and_its_own_bounds():
    recs = [{"workload": wl, "system": s, "column": s.rsplit("-t", 1)[0], metric: v,
             "loadavg_before": [1.0]}
            for wl, metric, rows in [
                ("classify", "requests_per_s", [("llama-server-t2", 4.0),
                                                ("freetoken-fp32", 6.0),
                                                ("freetoken-int8", 12.0)]),
                ("decode", "output_tokens_per_s", [("llama-server-t2", 70.0),
                                                   ("freetoken-fp32", 60.0),
                                                   ("freetoken-int8", 140.0)])]
            for s, v in rows]
    # int8 bound: 400 GOP/s / 20 GFLOP a request = 20 req/s; decode x8: 100 MB of weights +
    # 8 x 10 x 1 MB of KV = 180 MB a step at 45 GB/s -> 2000 tok/s
    bounds = {"int8_gops_peak": 400.0, "gemm_gflops_peak_fp32": 450.0,
              "bandwidth": {"read_gb_s": 45.0},
              "classify": {"gflop_per_request": 20.0},
              "decode": {"context_mean": 10.0, "flops_per_token": 1e9,
                         "bytes": {k: {"weights": 100e6, "kv_per_token": 1e6}
                                   for k in ("freetoken-fp32", "freetoken-int8",
                                             "llama-server")}}}
    report = pr.Report(recs, bounds, {}, {"started": "now", "reps": 1, "threads": 2}, 60.0)
    rows = {(a, b): c for a, b, c in report.ratio_rows(["classify", "decode"])
            if b.startswith("FreeToken int8")}
    peer = "FreeToken int8 / llama-server (best row: llama-server-t2)"
    assert rows[("classify", peer)] == pytest.approx(12 / 4)
    assert rows[("decode", peer)] == pytest.approx(140 / 70)
    assert rows[("classify", "FreeToken int8 / FreeToken fp32")] == pytest.approx(2.0)
    bound = [v for (w, k), v in rows.items() if k.startswith("FreeToken int8 / int8 compute")]
    assert bound == [pytest.approx(12 / 20)]
    band = [v for (w, k), v in rows.items() if k.startswith("FreeToken int8 / bandwidth bound")]
    assert band == [pytest.approx(140 / 2000)]


@pytest.mark.parametrize("leaked", ["OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT",
                                    "KMP_BLOCKTIME", "MKL_NUM_THREADS"])
def test_peers_run_in_their_default_environment(monkeypatch, leaked):
    """A peer gets no thread-tuning variable from the benchmark's shell (scripts/test exports
    OMP_WAIT_POLICY): llama-server at -t 1 and -t 2 and transformers run as their docs run
    them; only the rows named -passive, and FreeToken (as scripts/serve runs it), set
    OMP_WAIT_POLICY=PASSIVE."""
    monkeypatch.setenv(leaked, "PASSIVE" if "POLICY" in leaked else "2")
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    systems = {s.name: s for s in cp.systems_for(2)}
    for name in ("llama-server-t1", "llama-server-t2", "transformers"):
        env = systems[name].env()
        assert not [k for k in env if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))], name
        assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is kept
        assert systems[name].column is not None
    for name in ("freetoken-fp32", "freetoken-bf16", "llama-server-t2-passive",
                 "transformers-passive"):
        env = systems[name].env()
        assert env["OMP_WAIT_POLICY"] == "PASSIVE", name
        assert not [k for k in env if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))
                    and k != "OMP_WAIT_POLICY"], name
    assert systems["llama-server-t2-passive"].column is None
    cmd = cp.server_command(systems["llama-server-t1"], "m.gguf", 9, "/x/llama-server", 4096)
    assert cmd[:3] == ["/x/llama-server", "-m", "m.gguf"]
    assert cmd[cmd.index("-t") + 1] == "1" and cmd[cmd.index("-tb") + 1] == "1"
    assert not [a for a in cmd if "OMP" in a]
    cmd = cp.server_command(systems["llama-server-t2"], "m.gguf", 9, "/x/llama-server", 4096)
    assert cmd[cmd.index("-t") + 1] == "2"
    # scripts/serve gives FreeToken OMP_WAIT_POLICY=PASSIVE, as its system row does
    assert "OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}" in (ROOT / "scripts" / "serve").read_text()


def test_percentile_matches_numpy_linear():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert lg.percentile(xs, 50) == pytest.approx(2.5)
    assert lg.percentile(xs, 99) == pytest.approx(3.97)
    assert lg.percentile(xs, 0) == 1.0 and lg.percentile(xs, 100) == 4.0
    assert lg.percentile([7.0], 99) == 7.0
    assert math.isnan(lg.percentile([], 50))
    np = pytest.importorskip("numpy")
    ys = [float(i * i % 17) for i in range(37)]
    for q in (1, 50, 90, 99):
        assert lg.percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))


def test_summarize_rates_and_latencies():
    res = [lg.Result(ok=True, latency=1.0, ttft=0.2, output_tokens=5, prompt_tokens=10,
                     cached_tokens=8),
           lg.Result(ok=True, latency=3.0, ttft=0.4, output_tokens=9, prompt_tokens=10,
                     cached_tokens=2),
           lg.Result(ok=False, latency=0.5, error="HTTP 500")]
    s = lg.summarize(res, wall=2.0)
    assert s["requests"] == 3 and s["ok"] == 2 and s["errors"] == 1
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["output_tokens"] == 14 and s["output_tokens_per_s"] == pytest.approx(7.0)
    assert s["latency_p50_s"] == pytest.approx(2.0)
    assert s["latency_p99_s"] == pytest.approx(1.0 + 2.0 * 0.99)
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    # time per output token after the first: (1-0.2)/4 = 0.2 and (3-0.4)/8 = 0.325
    assert s["tpot_p50_s"] == pytest.approx((0.2 + 0.325) / 2)
    assert s["cached_tokens_frac"] == pytest.approx(0.5)
    assert s["prompt_tokens_mean"] == 10
