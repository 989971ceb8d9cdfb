"""The load generator (freetoken/testing/loadgen.py) end to end: a tiny classify and decode run
against a real `python -m freetoken` subprocess on a free loopback port."""

from __future__ import annotations

import os
import time

import pytest

from freetoken.testing import loadgen
from freetoken.testing.process import ServerProcess


@pytest.mark.real_model
def test_tiny_run_against_freetoken(tmp_path):
    server = ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "64MiB",
                            "--log-level", "warning"], log_path=tmp_path / "server.log",
                           env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        server.start(timeout_s=120)
        url = server.url
        t0 = time.time()
        rec = loadgen.run_once(url, "classify", n=6, concurrency=3, warmup=1, quiet=True,
                               dump=str(tmp_path / "dump.jsonl"))
        assert rec["errors"] == 0 and rec["ok"] == 6, rec.get("first_error")
        assert rec["output_tokens"] == 6 and rec["requests_per_s"] > 0
        assert rec["latency_p50_s"] <= rec["latency_p99_s"]
        assert rec["cached_tokens_frac"] > 0.5  # the shared prefix comes from the cache
        assert len(rec["loadavg_before"]) == 3
        dump = (tmp_path / "dump.jsonl").read_text().splitlines()
        assert len(dump) == 6 and '"top": {' in dump[0]
        rec = loadgen.run_once(url, "decode", n=2, concurrency=2, max_tokens=4, warmup=0,
                               quiet=True)
        assert rec["errors"] == 0 and rec["stream"] is True, rec.get("first_error")
        assert rec["output_tokens"] == 8  # ignore_eos: exactly max_tokens each
        assert 0 < rec["ttft_p50_s"] <= rec["latency_p50_s"]
        assert time.time() - t0 < 60
    finally:
        server.stop(timeout_s=20)
