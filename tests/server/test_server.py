"""The server over real HTTP against the real SmolLM2 (uvicorn in a thread, one per session),
plus one subprocess smoke test of `python -m freetoken`.

What these show (issue 5): the seed refusals and every other SPEC refusal; id prompts used
exactly; the seed-002 scoring reproduction; echo + logprobs equal to the engine's own prompt
logprobs; streaming == non-streaming; /metrics parses and moves.

One file: its tests share one real server per session (the SmolLM2 load is the cost).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from freetoken.testing.live import LiveServer
from freetoken.testing.process import ServerProcess

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = pytest.mark.real_model

MODEL = "smollm2"
MAX_MODEL_LEN = 512
YES, NO = 9230, 2838  # " Yes", " No" in SmolLM2's vocabulary
QUESTION = "Is the sky blue? Answer Yes or No:"
ID_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]  # "<|im_start|>system\n..."

_SERVER: dict = {}


def get_server() -> LiveServer:
    """One uvicorn thread over one real Engine for the whole session (shared with
    test_openai_client.py and test_scaleout.py)."""
    if "server" in _SERVER:
        return _SERVER["server"]
    import torch

    from freetoken.config import EngineConfig
    from freetoken.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(None, dtype=torch.float32, device="cpu")
    config = EngineConfig(
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=96 << 20,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    srv = LiveServer(loaded, config, start_timeout_s=60, http_timeout_s=120,
                     served_model_name=MODEL, max_batch_prompts=8, max_body_bytes=1 << 20)
    _SERVER["server"] = srv
    atexit.register(srv.close)
    return srv


@pytest.fixture(scope="module")
def srv() -> LiveServer:
    return get_server()


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,param,message",
    [
        ([], "prompt", "prompt: an empty token-id array cannot be evaluated"),
        ([1, "2"], "prompt[1]", "prompt[1] is not an integer token id"),
        ([999999999], "prompt[0]", "prompt[0] = 999999999 is outside the vocabulary (0..49151)"),
        ({"a": 1}, "prompt", "prompt must be a string or an array of token ids"),
    ],
)
def test_seed_refusals_exact(srv, prompt, param, message):
    e = error_of(srv.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}))
    assert e == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


REFUSALS = [
    # (body fields, param, a fragment of the message)
    ({"prompt": [[]]}, "prompt[0]", "prompt[0]: an empty token-id array"),
    ({"prompt": [[1, 2], []]}, "prompt[1]", "prompt[1]: an empty token-id array"),
    ({"prompt": ""}, "prompt", "prompt"),
    ({"prompt": [1, True]}, "prompt[1]", "prompt[1] is not an integer token id"),
    ({"prompt": [1, 2.5]}, "prompt[1]", "prompt[1] is not an integer token id"),
    ({"prompt": [[1, 2], [3, "4"]]}, "prompt[1][1]", "prompt[1][1] is not an integer token id"),
    (
        {"prompt": [[1], [2, 49152]]},
        "prompt[1][1]",
        "prompt[1][1] = 49152 is outside the vocabulary (0..49151)",
    ),
    ({"prompt": [-1]}, "prompt[0]", "prompt[0] = -1 is outside the vocabulary"),
    ({"prompt": ["a", 1]}, "prompt[1]", "prompt[1]"),
    ({"prompt": [[1], 2]}, "prompt[1]", "prompt[1]"),
    ({"prompt": 7}, "prompt", "prompt must be a string or an array of token ids"),
    ({"prompt": None}, "prompt", "prompt must be a string or an array of token ids"),
    ({"prompt": [[1]] * 9}, "prompt", "--max-batch-prompts"),
    (
        {"prompt": [1] * 500, "max_tokens": 20},
        "max_tokens",
        "You passed 500 input tokens and requested 20 output tokens; the context is 512",
    ),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids"),
    (
        {"prompt": "hi", "allowed_token_ids": [1, 2, 49152]},
        "allowed_token_ids[2]",
        "allowed_token_ids[2] = 49152 is outside the vocabulary (0..49151)",
    ),
    (
        {"prompt": "hi", "allowed_token_ids": [1, True]},
        "allowed_token_ids[1]",
        "allowed_token_ids[1]",
    ),
    ({"prompt": "hi", "logit_bias": {"50000": 1}}, "logit_bias.50000", "logit_bias.50000"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias.5", "logit_bias.5"),
    ({"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids[0]", "stop_token_ids[0]"),
    (
        {"prompt": "hi", "logprobs": 21},
        "logprobs",
        "Requested logprobs of 21, which is greater than max allowed: 20",
    ),
    ({"prompt": "hi", "logprob_token_ids": [5]}, "logprob_token_ids", "requires logprobs"),
    # the peers' behaviours (issue 22): an empty list, options for a stream that is not one,
    # every bad logit_bias key named at once
    (
        {"prompt": "hi", "logprobs": 1, "logprob_token_ids": []},
        "logprob_token_ids",
        "logprob_token_ids must not be empty",
    ),
    (
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (
        {"prompt": "hi", "stream": False, "stream_options": {"include_usage": False}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (
        {"prompt": "hi", "logit_bias": {"50000": 1, "3": 1, "x": 2, "49152": 1}},
        "logit_bias.50000, logit_bias.x, logit_bias.49152",
        "logit_bias.50000: token id 50000 is outside the vocabulary (0..49151); "
        "logit_bias.x: the key 'x' is not a token id; "
        "logit_bias.49152: token id 49152 is outside the vocabulary (0..49151)",
    ),
    ({"prompt": "hi", "best_of": 2}, "best_of", "best_of is not supported"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search", "use_beam_search is not"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "suffix is not supported"),
    ({"prompt": "hi", "guided_choice": ["a"]}, "guided_choice", "guided_choice is not supported"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a"}}, "structured_outputs", "not support"),
    ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format", "not sup"),
    ({"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds", "prompt_embeds is not"),
    ({"prompt": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "is not supported"),
    (
        {"prompt": "hi", "frobnicate": 1},
        "frobnicate",
        "Unrecognized request argument supplied: frobnicate",
    ),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "hi", "n": 0}, "n", "n"),
    ({"prompt": "hi", "stop": ["a", 1]}, "stop[1]", "stop[1]"),
    ({"prompt": "hi", "seed": 2**63}, "seed", "seed"),
    ({"prompt": "hi", "top_p": 1e-300}, "top_p", "float32"),
    ({"prompt": "hi", "temperature": 1e300}, "temperature", "float32"),
]


@pytest.mark.parametrize("body,param,fragment", REFUSALS)
def test_completion_refusals(srv, body, param, fragment):
    e = error_of(srv.post("/v1/completions", {"model": MODEL, "max_tokens": 1, **body}))
    assert e["type"] == "invalid_request_error"
    assert e["param"] == param, e
    assert fragment in e["message"], e


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": 2**63 - 128, "n": 2},
        {"seed": -(2**63), "n": 2},
        {"top_k": 10**9},
        {"temperature": 1e-300},
        {"min_p": 1e-300},
        {"top_p": 1e-38},
        {"logit_bias": {"00012": 5}},
    ],
)
def test_edge_values_are_served(srv, extra):
    # values at the edge of what the engine's int64/float32 can hold: served, never a 500
    out = srv.complete({"prompt": "Hello", "max_tokens": 1, "temperature": 1.0, **extra})
    assert out["usage"]["completion_tokens"] == extra.get("n", 1)


def test_neutral_values_accepted(srv):
    out = srv.complete(
        {
            "prompt": "hi",
            "max_tokens": 1,
            "best_of": 1,
            "use_beam_search": False,
            "suffix": None,
            "logit_bias": {},
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "u",
            "response_format": None,
            "temperature": 0,
        }
    )
    assert out["usage"]["completion_tokens"] == 1


CHAT_REFUSALS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    (
        {"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": [49152]},
        "allowed_token_ids[0]",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "foo": 1}, "foo"),
    (
        {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprob_token_ids": [5]},
        "logprob_token_ids",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "logprob_token_ids": []},
        "logprob_token_ids",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
         "logprob_token_ids": [5, 49152]},
        "logprob_token_ids[1]",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"49152": 1, "y": 1}},
        "logit_bias.49152, logit_bias.y",
    ),
]


@pytest.mark.parametrize("body,param", CHAT_REFUSALS)
def test_chat_refusals(srv, body, param):
    e = error_of(srv.post("/v1/chat/completions", {"model": MODEL, **body}))
    assert e["param"] == param, e
    field = param.split(".")[0].split("[")[0]
    assert field in e["message"] or "the context is 512" in e["message"], e


def test_other_errors(srv):
    e = error_of(srv.post("/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert e["message"] == "The model `gpt-9` does not exist." and e["type"] == "not_found_error"
    e = error_of(srv.http.post("/v1/completions", content=b"{not json"))
    assert e["param"] is None
    error_of(srv.post("/v1/completions", [1, 2]))
    error_of(srv.http.post("/v1/completions", content=b"x" * (2 << 20)), 413)
    error_of(srv.http.get("/v1/nothing-here"), 404)
    error_of(srv.http.get("/v1/completions"), 405)
    error_of(srv.http.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000))
    error_of(srv.post("/tokenize", {"prompt": 5}))
    e = error_of(srv.post("/detokenize", {"tokens": [1, 49152]}))
    assert e["param"] == "tokens[1]"


# ---- prompts --------------------------------------------------------------------------------


def test_id_prompt_used_exactly(srv):
    out = srv.complete({"prompt": ID_PROMPT, "max_tokens": 1, "temperature": 0, "echo": True})
    assert out["usage"]["prompt_tokens"] == len(ID_PROMPT)
    text = out["choices"][0]["text"]
    assert text.startswith("<|im_start|>system")  # the ids, nothing prepended
    # the same ids in a batch, twice
    out = srv.complete({"prompt": [ID_PROMPT, ID_PROMPT[:4]], "max_tokens": 1, "temperature": 0})
    assert out["usage"]["prompt_tokens"] == len(ID_PROMPT) + 4
    assert [c["index"] for c in out["choices"]] == [0, 1]


def test_text_prompt_follows_bos_rule(srv):
    tok = srv.engine.tokenizer
    ids = srv.post("/tokenize", {"prompt": QUESTION}).json()["tokens"]
    assert ids == tok.encode(QUESTION, add_special_tokens=True)
    assert (ids[0] == tok.bos_token_id) == bool(tok.add_bos_token)
    out = srv.complete({"prompt": QUESTION, "max_tokens": 1, "temperature": 0})
    assert out["usage"]["prompt_tokens"] == len(ids)
    # the text prompt and its ids give the same greedy answer
    out_ids = srv.complete({"prompt": ids, "max_tokens": 4, "temperature": 0})
    out_txt = srv.complete({"prompt": QUESTION, "max_tokens": 4, "temperature": 0})
    assert out_ids["choices"][0]["text"] == out_txt["choices"][0]["text"]


# ---- seed 002: the scoring reproduction -----------------------------------------------------


def test_seed_002_reproduction(srv):
    base = {"prompt": QUESTION, "max_tokens": 1, "temperature": 0}
    out = srv.complete({**base, "allowed_token_ids": [YES, NO]})
    assert out["choices"][0]["text"] in (" Yes", " No")
    # sampling, many tokens: every one stays in the set
    out = srv.complete(
        {
            **base,
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
            "allowed_token_ids": [YES, NO],
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
    )
    toks = out["choices"][0]["logprobs"]["tokens"]
    assert len(toks) == 12 and set(toks) <= {f"token_id:{YES}", f"token_id:{NO}"}
    # logprobs over the allowed set: only allowed ids, probabilities sum to 1
    for k in (2, 5):
        out = srv.complete(
            {
                **base,
                "allowed_token_ids": [YES, NO],
                "logprobs": k,
                "return_tokens_as_token_ids": True,
            }
        )
        lp = out["choices"][0]["logprobs"]
        top = lp["top_logprobs"][0]
        assert set(top) == {f"token_id:{YES}", f"token_id:{NO}"}
        assert abs(sum(math.exp(v) for v in top.values()) - 1.0) < 1e-4
        assert lp["tokens"][0] in top and all(t.startswith("token_id:") for t in lp["tokens"])
    # without return_tokens_as_token_ids the keys are text
    out = srv.complete({**base, "allowed_token_ids": [YES, NO], "logprobs": 2})
    assert set(out["choices"][0]["logprobs"]["top_logprobs"][0]) == {" Yes", " No"}
    # an id prompt, batched, as scoring clients send it
    ids = srv.engine.tokenizer.encode(QUESTION)
    out = srv.complete(
        {
            **base,
            "prompt": [ids, ids],
            "allowed_token_ids": [YES, NO],
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
        }
    )
    assert len(out["choices"]) == 2
    assert out["choices"][0]["logprobs"] == out["choices"][1]["logprobs"]
    e = error_of(
        srv.post("/v1/completions", {**base, "allowed_token_ids": [YES, NO], "logprobs": 21})
    )
    assert e["param"] == "logprobs" and "20" in e["message"]
    e = error_of(
        srv.post(
            "/v1/completions",
            {**base, "allowed_token_ids": [YES, NO], "guided_choice": ["Yes", "No"]},
        )
    )
    assert e["message"] == "guided_choice is not supported"


def test_top_logprobs_include_sampled_token(srv):
    # logprobs 1 with a logit_bias pushing a low-ranked token: top-1 plus the sampled one
    out = srv.complete(
        {
            "prompt": QUESTION,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 1,
            "logit_bias": {str(NO): 100},
            "return_tokens_as_token_ids": True,
        }
    )
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{NO}"]
    assert f"token_id:{NO}" in lp["top_logprobs"][0]


def test_logprob_token_ids(srv):
    out = srv.complete(
        {
            "prompt": QUESTION,
            "max_tokens": 2,
            "temperature": 0,
            "logprobs": 1,
            "logprob_token_ids": [YES, NO, 5],
            "return_tokens_as_token_ids": True,
        }
    )
    for top in out["choices"][0]["logprobs"]["top_logprobs"]:
        assert {f"token_id:{t}" for t in (YES, NO, 5)} <= set(top)


def test_chat_logprob_token_ids(srv):
    # vLLM takes logprob_token_ids on chat too; here the ids join the top K in top_logprobs
    body = {
        "messages": [{"role": "user", "content": "Is the sky blue? Answer Yes or No."}],
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "logprob_token_ids": [YES, NO, 5],
        "return_tokens_as_token_ids": True,
    }
    r = srv.post("/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    for e in content:
        tops = [(t["token"], t["logprob"]) for t in e["top_logprobs"]]
        assert {f"token_id:{t}" for t in (YES, NO, 5)} <= {t for t, _ in tops}
        assert len(tops) in (3, 4) and [v for _, v in tops] == sorted((v for _, v in tops),
                                                                      reverse=True)
        assert dict(tops).get(e["token"], e["logprob"]) == e["logprob"]
    chunks = sse(srv, "/v1/chat/completions", body)
    streamed = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert same_logprobs(streamed, content)


def test_allowed_logprobs(srv):
    # with allowed_token_ids: per position the log of the full distribution's mass on the set;
    # token_logprobs are renormalized over the set, so their sum with it is the plain logprob
    allowed = [YES, NO, 5, 28]
    body = {"prompt": QUESTION, "max_tokens": 3, "temperature": 0, "logprobs": 2,
            "allowed_token_ids": allowed, "logit_bias": {str(NO): 1.5},
            "return_tokens_as_token_ids": True}
    out = srv.complete({**body, "echo": True, "logprob_token_ids": [7]})
    lp = out["choices"][0]["logprobs"]
    assert all(top["token_id:7"] == -9999.0 for top in lp["top_logprobs"][-3:])  # outside
    n_prompt = out["usage"]["prompt_tokens"]
    masses = lp["allowed_logprobs"]
    assert len(masses) == len(lp["tokens"]) == n_prompt + 3
    assert masses[:n_prompt] == [None] * n_prompt  # the prompt is scored, not sampled
    gen = masses[n_prompt:]
    assert all(isinstance(m, float) and m <= 0 for m in gen)
    # the engine's own numbers (TokenLogprob.allowed_mass) for the same request
    from freetoken.engine.sampling_params import SamplingParams

    ids = srv.engine.tokenizer.encode(QUESTION)
    (ref,) = srv.engine.generate([ids], SamplingParams(
        max_tokens=3, temperature=0.0, logprobs=2, allowed_token_ids=allowed,
        logit_bias={NO: 1.5}))
    assert all(abs(a - tl.allowed_mass) < 1e-5 for a, tl in zip(gen, ref.logprobs))
    # position 0 without the set (same bias): the plain logprob of the token chosen
    tok0 = int(lp["tokens"][n_prompt].removeprefix("token_id:"))
    plain = srv.complete({"prompt": QUESTION, "max_tokens": 1, "temperature": 0, "logprobs": 0,
                          "logprob_token_ids": [tok0], "logit_bias": {str(NO): 1.5},
                          "return_tokens_as_token_ids": True})
    plain_lp = plain["choices"][0]["logprobs"]
    assert "allowed_logprobs" not in plain_lp  # no set: no key
    want = plain_lp["top_logprobs"][0][f"token_id:{tok0}"]
    assert abs(lp["token_logprobs"][n_prompt] + gen[0] - want) < 1e-4
    # streamed chunks carry their positions' values
    chunks = sse(srv, "/v1/completions", body)
    streamed = [m for c in chunks for m in (c["choices"][0]["logprobs"] or {})["allowed_logprobs"]]
    assert same_logprobs(streamed, gen)
    # chat: one allowed_logprob per content entry, streamed the same
    chat = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 2,
            "temperature": 0, "logprobs": True, "allowed_token_ids": allowed,
            "logprob_token_ids": [7], "return_tokens_as_token_ids": True}
    r = srv.post("/v1/chat/completions", {"model": MODEL, **chat})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(e["allowed_logprob"] <= 0 for e in content) and len(content) == 2
    # 7 is outside the set: logprob -inf, rendered -9999.0 as OpenAI and vLLM do (not a 500)
    for e in content:
        assert ("token_id:7", -9999.0) in [(t["token"], t["logprob"]) for t in e["top_logprobs"]]
    chunks = sse(srv, "/v1/chat/completions", chat)
    streamed = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert same_logprobs(streamed, content)
    r = srv.post("/v1/chat/completions", {"model": MODEL, **chat, "allowed_token_ids": None})
    assert all("allowed_logprob" not in e for e in r.json()["choices"][0]["logprobs"]["content"])


def test_same_text_ids_do_not_collide(srv):
    # 111 and 112 are partial UTF-8 bytes: each alone decodes to U+FFFD
    tok = srv.engine.tokenizer
    assert tok.decode([111], skip_special_tokens=False) == tok.decode([112], False) == "\ufffd"
    base = {"prompt": QUESTION, "max_tokens": 1, "temperature": 0, "logprobs": 0}
    out = srv.complete(
        {**base, "logprob_token_ids": [111, 112], "return_tokens_as_token_ids": True}
    )
    top = out["choices"][0]["logprobs"]["top_logprobs"][0]
    assert {"token_id:111", "token_id:112"} <= set(top) and len(top) == 3
    best = max(top["token_id:111"], top["token_id:112"])
    # with text keys the two collide on one key (docs/api.md: the higher-ranked one is kept)
    out = srv.complete({**base, "logprob_token_ids": [111, 112]})
    top = out["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 2 and abs(top["\ufffd"] - best) < 1e-4


# ---- echo / prompt logprobs -----------------------------------------------------------------


def test_echo_logprobs_equal_engine_prompt_logprobs(srv):
    from freetoken.engine.sampling_params import SamplingParams

    prompts = [ID_PROMPT, [4182, 260, 6376, 4461, 47]]
    out = srv.complete(
        {"prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    )
    ref = srv.engine.generate(
        prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=2)
    )
    for choice, ids, r in zip(out["choices"], prompts, ref, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [tl.logprob for tl in r.prompt_logprobs[1:]] + [r.logprobs[0].logprob]
        assert all(abs(a - b) < 1e-5 for a, b in zip(lp["token_logprobs"][1:], want)), (
            lp["token_logprobs"],
            want,
        )
        assert choice["text"].endswith(r.new_text) and out["usage"]["completion_tokens"] == 2
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert offsets[-1] == len(choice["text"]) - len(r.new_text)
        # real offsets: each prompt token's text is there (a generated EOS is not in the text)
        for off, tok in zip(offsets[: len(ids)], lp["tokens"]):
            assert choice["text"][off:].startswith(tok), (off, tok, choice["text"])


def test_echo_max_tokens_0_scores_prompt_only(srv):
    out = srv.complete({"prompt": [ID_PROMPT], "max_tokens": 0, "echo": True, "logprobs": 1})
    c = out["choices"][0]
    assert len(c["logprobs"]["tokens"]) == len(ID_PROMPT)
    assert c["text"] == srv.engine.tokenizer.decode(ID_PROMPT, skip_special_tokens=False)
    assert out["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_field(srv):
    out = srv.complete(
        {"prompt": ID_PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    )
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ID_PROMPT) and plp[0] is None
    for pos in range(1, len(ID_PROMPT)):
        assert str(ID_PROMPT[pos]) in plp[pos]
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in plp[pos].values())


# ---- streaming ------------------------------------------------------------------------------


def same_logprobs(a, b, tol: float = 1e-4) -> bool:
    """Equal structure, ids and text; floats within tol.

    NOTE: the second of two identical requests hits the prefix cache, which computes fewer
    tokens per matmul; fp32 rounding then differs by ~1e-6. Text and ids must match exactly.
    """
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_logprobs(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_logprobs(x, y, tol) for x, y in zip(a, b))
    return a == b


def sse(srv: LiveServer, path: str, body: dict) -> list:
    events = []
    with srv.http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_stream_equals_non_stream_completions(srv):
    body = {
        "prompt": "The three primary colors are",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
    }
    full = srv.complete(body)["choices"][0]
    chunks = sse(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text += choice["text"]
        for k in lp:
            lp[k] += (choice["logprobs"] or {}).get(k, [])
    assert text == full["text"]
    assert lp["tokens"] == full["logprobs"]["tokens"]
    assert lp["text_offset"] == full["logprobs"]["text_offset"]
    assert same_logprobs(lp, full["logprobs"])
    assert chunks[-2]["choices"][0]["finish_reason"] == full["finish_reason"] == "length"


def test_stream_equals_non_stream_chat(srv):
    body = {
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = srv.post("/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]
    chunks = sse(srv, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    content = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert text == full["message"]["content"]
    assert [e["token"] for e in content] == [e["token"] for e in full["logprobs"]["content"]]
    assert same_logprobs(content, full["logprobs"]["content"])
    for e in content:
        assert (
            set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        )


def test_stream_n_and_batch_one_choice_per_chunk(srv):
    chunks = sse(
        srv,
        "/v1/completions",
        {
            "prompt": [[4182, 260], [6376, 4461]],
            "n": 2,
            "max_tokens": 3,
            "temperature": 0.8,
            "seed": 1,
        },
    )
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}


def _wait_aborted(engine, seen: list) -> None:
    deadline = time.time() + 20
    while not seen and time.time() < deadline:
        time.sleep(0.05)
    assert seen, "the engine request was not aborted"
    while engine.stats()["num_running"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats()["num_running"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(srv, stream):
    engine = srv.engine
    seen = []
    orig = engine.abort
    engine.abort = lambda rid: (seen.append(rid), orig(rid))[1]
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "stream": stream,
        "max_tokens": 400,
        "ignore_eos": True,
    }
    try:
        if stream:
            with srv.http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
        _wait_aborted(engine, seen)
    finally:
        engine.abort = orig


# ---- failures that are FreeToken's, not the client's ----------------------------------------


def test_engine_is_an_engine_client(srv):
    from freetoken.api.engine_client import EngineClient, EngineSettings

    assert isinstance(srv.engine, EngineClient)  # every member the edge calls is there
    assert isinstance(srv.engine.config, EngineSettings)


@pytest.fixture
def patched_submit(srv):
    orig = srv.engine.submit
    yield lambda fn: setattr(srv.engine, "submit", fn)
    srv.engine.submit = orig


def test_engine_error_is_500_with_request_id(srv, patched_submit):
    from freetoken.engine import RequestOutput

    def failing(prompt_ids, params, request_id=None):
        async def gen():
            yield RequestOutput(request_id, new_token_ids=[87], new_text="x")
            yield RequestOutput(request_id, finished=True, finish_reason="error", error="boom")

        return gen()

    patched_submit(failing)
    r = srv.post("/v1/completions", {"prompt": "hi"})
    e = error_of(r, 500)
    assert e["type"] == "server_error" and r.headers["x-request-id"] in e["code"]
    events = sse(srv, "/v1/completions", {"prompt": "hi"})
    assert events[0]["choices"][0]["text"] == "x"
    assert set(events[-1]) == {"error"} and events[-1]["error"]["type"] == "server_error"


def test_unexpected_exception_is_500_with_request_id(srv, patched_submit):
    def broken(*args, **kwargs):
        raise RuntimeError("a FreeToken bug")

    patched_submit(broken)
    r = srv.post("/v1/completions", {"prompt": "hi"})
    e = error_of(r, 500)
    assert e["code"] == r.headers["x-request-id"] and e["code"] in e["message"]
    assert "bug" not in e["message"]  # internals stay in the log


def test_health_503_when_engine_dead(srv, monkeypatch):
    monkeypatch.setattr(srv.engine, "is_alive", lambda: False)
    e = error_of(srv.http.get("/health"), 503)
    assert e["type"] == "unavailable_error"


def test_overloaded_is_503_with_retry_after(srv, patched_submit):
    from freetoken.errors import Overloaded

    def full(*args, **kwargs):
        raise Overloaded(retry_after_s=2)

    patched_submit(full)
    r = srv.post("/v1/completions", {"prompt": "hi"})
    e = error_of(r, 503)
    assert e["type"] == "overloaded" and r.headers["retry-after"] == "2"


def test_concurrent_requests_equal_alone(srv):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Item {i}: the colour of the sea is" for i in range(6)]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [srv.complete({**body, "prompt": p})["choices"][0]["text"] for p in prompts]

    def one(i: int) -> str:
        p = prompts[i % len(prompts)]
        if i % 2:
            chunks = sse(srv, "/v1/completions", {**body, "prompt": p})
            return "".join(c["choices"][0]["text"] for c in chunks)
        return srv.complete({**body, "prompt": p})["choices"][0]["text"]

    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(one, range(12)))
    assert together == [alone[i % len(prompts)] for i in range(12)]


# ---- sampling fields ------------------------------------------------------------------------


def test_seed_and_n(srv):
    body = {
        "prompt": "My favourite animal is",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
        "logprobs": 0,
    }
    a, b = srv.complete(body), srv.complete(body)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert a["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in a["choices"]
    )
    assert a["usage"]["prompt_tokens"] == len(srv.engine.tokenizer.encode(body["prompt"]))


def test_stop_string(srv):
    base = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    full = srv.complete(base)["choices"][0]["text"]
    assert " 7" in full, full
    cut = srv.complete({**base, "stop": [" 7"]})["choices"][0]
    assert cut["text"] == full[: full.index(" 7")] and cut["finish_reason"] == "stop"
    assert cut["stop_reason"] == " 7"
    kept = srv.complete({**base, "stop": " 7", "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"] == full[: full.index(" 7") + 2]


def test_scoring_requests_use_the_prefix_cache(srv):
    ids = list(range(2000, 2070))
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    cold, warm = srv.complete(body), srv.complete(body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    a, b = cold["choices"][0]["logprobs"], warm["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and same_logprobs(a, b)


def test_prefix_cache_cached_tokens(srv):
    ids = list(range(1000, 1100))
    srv.complete({"prompt": ids, "max_tokens": 1, "temperature": 0})
    out = srv.complete({"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


# ---- chat and the other endpoints -----------------------------------------------------------


def test_chat_and_tokenize_count(srv):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = srv.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    tk = srv.post("/tokenize", {"messages": msgs}).json()
    assert tk["count"] == out["usage"]["prompt_tokens"] == len(tk["tokens"])
    assert tk["tokens"][0] == 1 and tk["tokens"][1] != 1  # the template's BOS, once
    assert (
        srv.post("/detokenize", {"tokens": tk["tokens"]})
        .json()["prompt"]
        .startswith("<|im_start|>system\nBe brief.")
    )


def test_info_endpoints(srv):
    m = srv.http.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL
    assert m["data"][0]["owned_by"] == "freetoken" and m["data"][0]["max_model_len"] == 512
    info = srv.http.get("/tokenizer_info").json()
    assert info["vocab_size"] == 49152 and info["eos_token"] == "<|im_end|>"
    assert "bos_token" in info
    assert srv.http.get("/health").status_code == 200
    assert "version" in srv.http.get("/version").json()
    doc = srv.http.get("/openapi.json").json()
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert schema["additionalProperties"] is False and "allowed_token_ids" in schema["properties"]
    assert "/v1/chat/completions" in doc["paths"]


def test_metrics_parse_and_move(srv):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = srv.http.get("/metrics").text
        values = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                values[key] = s.value
        return values

    before = scrape()
    srv.complete({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    srv.post("/v1/completions", {"prompt": []})
    after = scrape()
    for name in (
        "freetoken_requests_running",
        "freetoken_requests_waiting",
        "freetoken_kv_blocks_used",
        "freetoken_kv_blocks_total",
        "freetoken_prefix_cache_queries_total",
        "freetoken_prefix_cache_hits_total",
        "freetoken_time_to_first_token_seconds_count",
        "freetoken_e2e_request_latency_seconds_count",
    ):
        assert name in after, name
    assert after["freetoken_prompt_tokens_total"] > before.get("freetoken_prompt_tokens_total", 0)
    assert (
        after["freetoken_generation_tokens_total"]
        >= before.get("freetoken_generation_tokens_total", 0) + 3
    )
    assert after["freetoken_e2e_request_latency_seconds_count"] > before.get(
        "freetoken_e2e_request_latency_seconds_count", 0
    )
    key = 'freetoken_request_success_total{"finish_reason": "length"}'
    assert after[key] > before.get(key, 0)
    key = 'freetoken_request_errors_total{"type": "invalid_request_error"}'
    assert after[key] > before.get(key, 0)
    assert after["freetoken_prefix_cache_queries_total"] > before.get(
        "freetoken_prefix_cache_queries_total", 0
    )


# ---- the CLI, as a subprocess ---------------------------------------------------------------


def test_cli_subprocess_smoke(tmp_path: Path):
    helptext = subprocess.run(
        [sys.executable, "-m", "freetoken", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--model",
        "--host",
        "--port",
        "--served-model-name",
        "--max-logprobs",
        "--max-model-len",
        "--kv-cache-memory",
        "--max-num-seqs",
        "--api-key",
        "--dtype",
        "--device",
        "--no-prefix-cache",
        "--max-batch-prompts",
    ):
        assert flag in helptext, flag
    server = ServerProcess(
        [
            "--api-key",
            "sekret",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "32MiB",
            "--served-model-name",
            "m",
        ],
        log_path=tmp_path / "server.log",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        server.start(timeout_s=120)
        url = server.url
        body = {"model": "m", "prompt": [1, 9690], "max_tokens": 2, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        r = httpx.post(
            url + "/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sekret"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 2
        assert httpx.get(url + "/metrics").status_code == 200
    finally:
        server.stop()
    text = (tmp_path / "server.log").read_text()
    assert "prompt_tokens=2" in text and "status=200" in text  # the per-request log line
    assert "kernel backend" in text
