"""Fuzzing /v1/completions and /v1/chat/completions bodies with hypothesis (issue 7).

Bodies are built from every field of the request models (so a field added to protocol/requests.py
is fuzzed too), each with plausible values, edge values and arbitrary JSON, plus unknown fields and
raw bytes. For every one: no 500, no hang (the client's timeout would raise), and the response
is either the OpenAI error shape with a documented status or a valid completion (streamed or
not). Runs against the in-process server of test_reliability (uvicorn thread, real SmolLM2),
derandomized, so CI sees the same examples on every run.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from freetoken.protocol.requests import ChatCompletionRequest, CompletionRequest
from freetoken.testing.live import LiveServer

pytestmark = pytest.mark.real_model

VOCAB = 49152
# status -> the error types it may carry
DOCUMENTED = {
    400: {"invalid_request_error"},
    404: {"not_found_error"},
    405: {"invalid_request_error"},
    413: {"invalid_request_error"},
    503: {"overloaded", "unavailable_error"},
    504: {"timeout_error"},
}
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)  # fmt: skip

scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
any_json = st.recursive(
    scalar,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=8,
)
token_id = st.integers(0, VOCAB - 1) | st.sampled_from([-1, VOCAB, 2**31, 2**64])
ids = st.lists(token_id, max_size=12)
small_int = st.integers(-2, 6)
text = st.text(max_size=40)


def _field_strategies(chat: bool) -> dict:
    """A strategy per request field: plausible, edge and arbitrary values."""
    s = {
        "model": st.sampled_from([None, "m", "gpt-4", ""]),
        "temperature": st.floats(0, 3) | st.sampled_from([-1, 0, 1e-9, 1e39]),
        "top_p": st.floats(0, 1.5),
        "top_k": st.integers(-3, 100) | st.just(10**12),
        "min_p": st.floats(-0.5, 1.5),
        "seed": st.integers(-(2**64), 2**64),
        "n": st.sampled_from([0, 1, 2, 3, 65, 129, 10**9]),
        "stop": text | st.lists(text, max_size=4),
        "stop_token_ids": ids,
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(-1, 4),
        "logit_bias": st.dictionaries(
            st.sampled_from(["0", "5", "49151", "49152", "-1", "x", " 7 "]),
            st.floats(-150, 150),
            max_size=4,
        ),
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
        "repetition_penalty": st.floats(-1, 3),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "allowed_token_ids": ids,
        "return_tokens_as_token_ids": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
        "best_of": st.sampled_from([None, 1, 2]),
        "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    }
    if chat:
        content = (
            text
            | st.none()
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": text}
                ),
                max_size=2,
            )
        )
        msg = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
            optional={"content": content, "name": st.text(max_size=5)},
        )
        s |= {
            "messages": st.lists(msg, max_size=4) | any_json,
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(-1, 22),
            "max_completion_tokens": small_int,
            "add_generation_prompt": st.booleans(),
            "tools": st.sampled_from([None, [], [{"type": "function"}]]),
        }
    else:
        s |= {
            "prompt": text | ids | st.lists(text, max_size=3) | st.lists(ids, max_size=3),
            "echo": st.booleans(),
            "logprobs": st.integers(-1, 22),
            "logprob_token_ids": ids,
            "prompt_logprobs": st.integers(-1, 22),
            "add_special_tokens": st.booleans(),
            "suffix": st.sampled_from([None, "", "x"]),
        }
    s["max_tokens"] = small_int | st.sampled_from([None, 300, 2**63])
    model = ChatCompletionRequest if chat else CompletionRequest
    for name in model.model_fields:  # every other field: arbitrary JSON
        s.setdefault(name, any_json)
    # each field: its own strategy most of the time, arbitrary JSON sometimes
    return {k: v | any_json for k, v in s.items()}


def _valid_fields(chat: bool) -> tuple[dict, dict]:
    """(required, optional) strategies of values that are each valid on their own, so that
    many bodies pass validation and reach the engine (and the response builders)."""
    vid = st.integers(0, VOCAB - 1)
    vids = st.lists(vid, min_size=1, max_size=6)
    words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
    opt = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1),
        "seed": st.integers(0, 2**32),
        "n": st.integers(1, 2),
        "stop": words | st.lists(words, max_size=3),
        "stop_token_ids": vids,
        "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(vid.map(str), st.floats(-100, 100), max_size=3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2),
        "allowed_token_ids": vids,
        "return_tokens_as_token_ids": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": words,
    }
    if chat:
        msg = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": words}
        )
        req = {"messages": st.lists(msg, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)}
        opt |= {"logprobs": st.just(True), "top_logprobs": st.integers(0, 5),
                "logprob_token_ids": vids}  # fmt: skip
    else:
        prompt = words | vids | st.lists(words, min_size=1, max_size=3)
        req = {"prompt": prompt | st.lists(vids, min_size=1, max_size=3),
               "max_tokens": st.integers(1, 4)}  # fmt: skip
        opt |= {
            "logprobs": st.integers(0, 5),
            "echo": st.booleans(),
            "prompt_logprobs": st.integers(0, 3),
            "add_special_tokens": st.booleans(),
        }
    return req, opt


def _stream_options_with_stream_only(body: dict) -> dict:
    # stream_options without stream: true is a 400 (as OpenAI and vLLM): not a valid body
    return body if body.get("stream") else {k: v for k, v in body.items() if k != "stream_options"}


def bodies(chat: bool):
    req, opt = _valid_fields(chat)
    valid = st.fixed_dictionaries(req, optional=opt).map(_stream_options_with_stream_only)
    fields = _field_strategies(chat)
    required = "messages" if chat else "prompt"
    # NOTE: chat without max_tokens generates to the context's end: keep it mostly present
    base = {required: fields.pop(required), "max_tokens": fields.pop("max_tokens")}
    body = st.fixed_dictionaries(base, optional=fields)
    junk = st.dictionaries(st.text(min_size=1, max_size=10), any_json, max_size=2)
    return st.one_of(valid, body, valid, st.tuples(body, junk).map(lambda t: {**t[1], **t[0]}))


@pytest.fixture(scope="module")
def fuzz_srv(smollm2_fp32):
    import torch

    torch.set_num_threads(1)
    loaded = smollm2_fp32
    # the deadline bounds any valid body that asks for a long generation (504 is documented)
    s = LiveServer(loaded, engine=dict(max_num_seqs=16), max_batch_prompts=4, request_timeout_s=10)
    yield s
    s.close()


def check_response(r, chat: bool) -> None:
    event(f"status {r.status_code}")  # pytest --hypothesis-show-statistics
    assert r.status_code != 500, r.text[:500]
    if r.status_code != 200:
        body = r.json()
        assert set(body) == {"error"}, body
        e = body["error"]
        assert set(e) == {"message", "type", "param", "code"}, e
        assert isinstance(e["message"], str) and e["message"]
        assert r.status_code in DOCUMENTED and e["type"] in DOCUMENTED[r.status_code], body
        assert e["param"] is None or isinstance(e["param"], str)
        return
    ctype = r.headers.get("content-type")
    ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis: lists of values
    if ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        finishes = 0
        for raw in events[:-1]:
            ev = json.loads(raw)
            if "error" in ev:  # only documented errors mid-stream (the deadline)
                assert ev["error"]["type"] == "timeout_error", ev
                continue
            assert ev["object"] == ("chat.completion.chunk" if chat else "text_completion")
            for c in ev["choices"]:
                assert isinstance(c["index"], int)
                finishes += c["finish_reason"] is not None
                assert c["finish_reason"] in (None, "stop", "length"), c
        return
    d = r.json()
    assert d["object"] == ("chat.completion" if chat else "text_completion"), d
    assert d["choices"] and all(c["finish_reason"] in ("stop", "length") for c in d["choices"])
    for c in d["choices"]:
        assert isinstance(c["message"]["content"] if chat else c["text"], str)
    u = d["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@settings(max_examples=200, **SETTINGS)
@given(body=bodies(chat=False))
def test_fuzz_completions(fuzz_srv, body):
    check_response(fuzz_srv.http.post("/v1/completions", json=body, timeout=60), chat=False)


@settings(max_examples=100, **SETTINGS)
@given(body=bodies(chat=True))
def test_fuzz_chat(fuzz_srv, body):
    check_response(fuzz_srv.http.post("/v1/chat/completions", json=body, timeout=60), chat=True)


@settings(max_examples=100, **SETTINGS)
@given(
    raw=st.binary(max_size=64)
    | any_json.map(lambda v: json.dumps(v).encode())
    | st.sampled_from(
        [
            b"",
            b"{",
            b'{"prompt": NaN}',
            b'{"prompt": Infinity}',
            b"[" * 5000,
            b'{"prompt": "\\ud800"}',
            b'{"prompt": 1e999}',
            b"\xff\xfe",
        ]
    ),  # fmt: skip
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_fuzz_raw_bodies(fuzz_srv, raw, path):
    r = fuzz_srv.http.post(path, content=raw, headers={"content-type": "application/json"})
    check_response(r, chat=path.endswith("chat/completions"))


def test_fuzz_left_the_server_clean(fuzz_srv):
    fuzz_srv.wait_idle()
    assert fuzz_srv.stats()["step_errors_total"] == 0
    assert fuzz_srv.http.get("/health").status_code == 200
