"""What a router asks one replica for (freetoken/api/scaleout.py, metrics.py), against the session's
in-process server over real HTTP (test_server.get_server), plus the cluster helper's process
handling without a model (freetoken/cluster.py).

- the vLLM render endpoints: vLLM's shapes (tests/entrypoints/openai/cpu/test_render.py), the ids
  the engine would see (text, BOS, chat template; id prompts exactly), the generation request's
  own 400 / 404, nothing generated;
- /get_load in the `{"load": N}` shape vllm-router reads, /loads and /v1/loads;
- /metrics under vLLM's names, labelled with the served model name, moving with the engine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from freetoken import cluster as cl

MODEL_ = "smollm2"


@pytest.fixture(scope="module")
def srv():
    from test_server import get_server

    return get_server()


def _json(r, status=200):
    assert r.status_code == status, r.text
    return r.json()


# ---- render ----------------------------------------------------------------------------------


def test_completion_render_text_prompt(srv):
    text = "When should a chat-completions handler return an empty string?"
    data = _json(srv.post("/v1/completions/render", {"model": MODEL_, "prompt": text}))
    assert isinstance(data, list) and len(data) == 1
    first = data[0]
    tok = srv.post("/tokenize", {"prompt": text}).json()["tokens"]  # same BOS rule as generation
    assert first["prompt_token_ids"] == first["token_ids"] == tok
    assert text in first["prompt"]
    assert first["request_id"].startswith("cmpl-")
    assert first["model"] == MODEL_
    assert first["sampling_params"]["max_tokens"] == 16
    # the ids the engine computes for the same request: usage.prompt_tokens agrees
    done = srv.complete({"prompt": text, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(first["token_ids"])


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ([1, 9690, 198, 2683], [[1, 9690, 198, 2683]]),
        ([[5, 6], [7, 8, 9]], [[5, 6], [7, 8, 9]]),
    ],
    ids=["list[int]", "list[list[int]]"],
)
def test_completion_render_id_prompts_are_used_exactly(srv, prompt, expected):
    data = _json(srv.post("/v1/completions/render", {"prompt": prompt}))
    assert [d["token_ids"] for d in data] == expected
    assert [d["prompt_token_ids"] for d in data] == expected
    assert all(isinstance(d["prompt"], str) for d in data)


def test_completion_render_multiple_text_prompts(srv):
    data = _json(srv.post("/v1/completions/render", {"prompt": ["Hello world", "Goodbye world"]}))
    assert len(data) == 2
    assert [d["prompt"] for d in data] == ["Hello world", "Goodbye world"]
    assert all(len(d["prompt_token_ids"]) > 0 for d in data)
    assert len({d["request_id"] for d in data}) == 2


def test_chat_render_matches_the_chat_request(srv):
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "How are you?"},
    ]
    data = _json(srv.post("/v1/chat/completions/render", {"model": MODEL_, "messages": messages}))
    assert isinstance(data, dict)
    assert data["token_ids"] == srv.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert all(isinstance(t, int) for t in data["token_ids"])
    assert data["request_id"].startswith("chatcmpl-")


def test_chat_render_keeps_stream_and_sampling_fields(srv):
    body = {
        "messages": [{"role": "user", "content": "Stream options should be accepted."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.123,
        "top_p": 0.456,
        "frequency_penalty": 1.1,
    }
    r = srv.post("/v1/chat/completions/render", body)
    assert r.headers["content-type"].startswith("application/json")
    data = _json(r)
    assert data["stream"] is True
    assert data["stream_options"]["include_usage"] is True
    sp = data["sampling_params"]
    assert sp["temperature"] == 0.123 and sp["top_p"] == 0.456 and sp["frequency_penalty"] == 1.1
    assert not any(k.startswith("_") for k in sp)


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions/render", {"model": "nope", "prompt": "x"}, 404, "model"),
        (
            "/v1/chat/completions/render",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model",
        ),
        ("/v1/completions/render", {"prompt": []}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": [999999999]}, 400, "prompt[0]"),
        ("/v1/completions/render", {"prompt": "x", "best_of": 3}, 400, "best_of"),
        ("/v1/completions/render", {"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
    ],
)
def test_render_refuses_what_generation_refuses(srv, path, body, status, param):
    err = _json(srv.post(path, body), status)["error"]
    assert err["param"] == param
    gen = path.removesuffix("/render")
    assert srv.post(gen, body).json() == {"error": err}  # the very same refusal


def test_render_generates_nothing(srv):
    before = srv.engine.stats()["generation_tokens_total"]
    _json(srv.post("/v1/completions/render", {"prompt": "Tell me a very long story " * 20}))
    assert srv.engine.stats()["generation_tokens_total"] == before


def test_router_defaults_are_accepted(srv):
    """vllm-router re-serializes every request and adds these neutral defaults."""
    comp = {
        "prompt": "Hi",
        "max_tokens": 1,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    }
    assert srv.post("/v1/completions", comp).status_code == 200
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "stream": False,
        "logprobs": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "include_reasoning": True,
    }
    assert srv.post("/v1/chat/completions", chat).status_code == 200
    for field, value in (("no_stop_trim", True), ("return_hidden_states", True)):
        err = _json(srv.post("/v1/completions", {**comp, field: value}), 400)["error"]
        assert err["param"] == field
    err = _json(srv.post("/v1/chat/completions", {**chat, "include_reasoning": False}), 400)
    assert err["error"]["param"] == "include_reasoning"


# ---- load reports ----------------------------------------------------------------------------


def test_get_load_has_the_routers_load_field(srv):
    data = _json(srv.http.get("/get_load"))
    assert isinstance(data["load"], int) and data["load"] >= 0
    assert data["num_reqs"] == data["load"]
    for key in ("dp_rank", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic"):
        assert key in data
    total = srv.engine.stats()["kv_blocks_total"] * srv.engine.config.block_size
    assert data["num_tokens"] + data["num_pending_tokens"] == total


@pytest.mark.parametrize("path", ["/loads", "/v1/loads"])
def test_loads_report(srv, path):
    data = _json(srv.http.get(path))
    assert isinstance(data["timestamp"], float)
    (rank,) = data["loads"]
    stats = srv.engine.stats()
    assert rank["dp_rank"] == 0
    assert rank["max_total_num_tokens"] == stats["kv_blocks_total"] * srv.engine.config.block_size
    assert 0.0 <= rank["kv_cache_usage"] <= 1.0
    assert rank["prefix_cache_queries"] >= rank["prefix_cache_hits"] >= 0


def test_load_counts_requests_in_flight(srv):
    import threading

    seen = []
    body = {"prompt": "Count slowly from one to one hundred:", "max_tokens": 48, "ignore_eos": True}
    t = threading.Thread(target=lambda: srv.complete(body))
    t.start()
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        seen.append(srv.http.get("/get_load").json()["load"])
        time.sleep(0.02)
    t.join(60)
    assert max(seen) >= 1, seen
    assert srv.http.get("/get_load").json()["load"] == 0


# ---- metrics under vLLM's names --------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{engine="0",model_name="{MODEL_}"\}} (\S+)$', text, re.M)
    assert m, f"{name} is missing or unlabelled"
    return float(m.group(1))


def test_vllm_metric_names(srv):
    names = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
    ]
    text = srv.http.get("/metrics").text
    for name in names:
        _metric(text, name)
    assert "# TYPE vllm:num_requests_running gauge" in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert 0.0 <= _metric(text, "vllm:kv_cache_usage_perc") <= 1.0


def test_vllm_prefix_counters_move_with_a_cache_hit(srv):
    prompt = "A shared prefix long enough to fill two KV blocks of sixteen tokens each, " * 2
    srv.complete({"prompt": prompt + "first", "max_tokens": 1})
    before = srv.http.get("/metrics").text
    done = srv.complete({"prompt": prompt + "second", "max_tokens": 1})
    after = srv.http.get("/metrics").text
    cached = done["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    hits = _metric(after, "vllm:prefix_cache_hits_total") - _metric(
        before, "vllm:prefix_cache_hits_total"
    )
    assert hits == cached
    assert _metric(after, "vllm:gpu_prefix_cache_hits_total") == _metric(
        after, "vllm:prefix_cache_hits_total"
    )
    assert _metric(after, "vllm:prefix_cache_queries_total") > _metric(
        before, "vllm:prefix_cache_queries_total"
    )


# ---- the cluster helper's processes (no model) -----------------------------------------------


def test_stop_group_ends_forked_children():
    """vllm-router forks; stopping must end the child too, so each process leads its own group."""
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 300 & sleep 300 & wait"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    assert cl._group_alive(proc)
    t = time.monotonic()
    cl._stop_group(proc, timeout=5)
    assert time.monotonic() - t < 6
    assert proc.poll() is not None
    assert not cl._group_alive(proc)


def test_stop_group_kills_what_ignores_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print('ready', flush=True); time.sleep(300)",
        ],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout.readline().strip() == b"ready"
    cl._stop_group(proc, timeout=0.5)
    assert proc.wait(5) == -signal.SIGKILL


def test_cluster_start_failure_stops_what_started(tmp_path):
    """A replica that cannot start: start() raises within its bound and leaves nothing behind."""
    c = cl.Cluster(
        2,
        replica_args=["--model", str(tmp_path / "missing.gguf")],
        log_dir=tmp_path,
        startup_timeout=60,
        env=dict(os.environ),
    )
    with pytest.raises(RuntimeError, match="replica 0 .* exited"):
        c.start()
    assert all(p.poll() is not None for p in c.replicas)
    assert c.router is None
    assert "no such file" in (tmp_path / "replica0.log").read_text()


def test_cluster_cli_help():
    out = subprocess.run(
        [sys.executable, "-m", "freetoken.cluster", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--policy" in out.stdout and "--replicas" in out.stdout
