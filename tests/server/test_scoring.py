"""The scoring routes over HTTP (issue 22): /v1/generative-scores (vLLM's shape) and /v1/score
(SGLang's), single- and multi-token labels, on the real SmolLM2 and on a tiny checkpoint
against transformers.

What these show: every label's numbers are bit for bit those of a plain echo request on
query + item + label (the kernels are batch invariant: issue 23); label_token_ids and one-token
`labels` give the same numbers; item order and the prefix cache (on, off, warm) change nothing;
the request bodies of vLLM's and SGLang's docs work; every refusal names its field and position;
the KV is all given back.
"""

from __future__ import annotations

import math

import pytest
from test_server import error_of, get_server

from freetoken.testing.live import LiveServer

pytestmark = pytest.mark.real_model

QUERY = ("Review: the soup was cold, the waiter forgot our order and the bill was wrong. "
         "Is this review positive or negative? The review is")
ITEMS = [" clearly", " honestly", " in my opinion", " probably", " definitely not"]
LABELS = [" very positive", " positive", " negative", " mixed feelings"]


@pytest.fixture(scope="module")
def srv() -> LiveServer:
    return get_server()


def score(srv: LiveServer, path: str, body: dict) -> dict:
    r = srv.post(path, {"model": srv.model, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ids(srv: LiveServer, text: str, special: bool = False) -> list[int]:
    return list(srv.engine.tokenizer.encode(text, add_special_tokens=special))


def echo_logprobs(srv: LiveServer, prompt: list[int], start: int) -> list[float]:
    """Plain /v1/completions echo scoring: the logprobs of prompt[start:]."""
    out = srv.complete({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    return out["choices"][0]["logprobs"]["token_logprobs"][start:]


def test_multi_token_labels_equal_echo_requests(srv):
    body = score(srv, "/v1/generative-scores", {"query": QUERY, "items": ITEMS, "labels": LABELS})
    lengths = [len(ids(srv, lab)) for lab in LABELS]
    assert min(lengths) == 1 and max(lengths) >= 2  # one- and multi-token labels
    assert body["object"] == "generative_score" and len(body["results"]) == len(ITEMS)
    q = ids(srv, QUERY, special=True)
    for i, item in enumerate(ITEMS):
        res = body["results"][i]
        assert res["index"] == i
        prompt = q + ids(srv, item)
        sums = []
        for j, label in enumerate(LABELS):
            lab = res["labels"][j]
            assert lab["token_ids"] == ids(srv, label)
            want = echo_logprobs(srv, prompt + lab["token_ids"], len(prompt))
            assert len(want) == len(lab["token_logprobs"])
            assert lab["token_logprobs"] == want, (i, j)
            assert math.isclose(lab["logprob"], math.fsum(lab["token_logprobs"]), abs_tol=1e-12)
            sums.append(lab["logprob"])
        # apply_softmax (vLLM's default): the distribution over the labels
        top = max(sums)
        z = math.fsum(math.exp(s - top) for s in sums)
        want = [math.exp(s - top) / z for s in sums]
        assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(res["label_probs"], want))
        assert math.isclose(sum(res["label_probs"]), 1.0, rel_tol=1e-12)
    # usage: what separate echo requests would send; the shared query and items were cached
    usage = body["usage"]
    want_prompt = sum(len(q) + len(ids(srv, it)) for it in ITEMS) + len(ITEMS) * sum(
        len(ids(srv, lab)) for lab in LABELS)
    assert usage["prompt_tokens"] == want_prompt and usage["completion_tokens"] == 0
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert computed <= len(q) + sum(len(ids(srv, it)) for it in ITEMS) + len(ITEMS) * sum(
        len(ids(srv, lab)) for lab in LABELS)
    srv.wait_idle()


def test_single_token_labels_both_fields_both_routes(srv):
    yes, no = ids(srv, " Yes"), ids(srv, " No")
    assert len(yes) == len(no) == 1
    ltids = [yes[0], no[0]]
    g = score(srv, "/v1/generative-scores", {"query": QUERY, "items": ITEMS,
                                             "label_token_ids": ltids, "apply_softmax": False})
    m = score(srv, "/v1/generative-scores", {"query": QUERY, "items": ITEMS,
                                             "labels": [" Yes", " No"], "apply_softmax": False})
    s = score(srv, "/v1/score", {"query": QUERY, "items": ITEMS, "label_token_ids": ltids})
    assert s["object"] == "scoring" and len(s["scores"]) == len(ITEMS)
    q = ids(srv, QUERY, special=True)
    for i, item in enumerate(ITEMS):
        probs = g["results"][i]["token_probs"]
        assert set(probs) == {str(t) for t in ltids}
        # SGLang's default apply_softmax is false too: the full-vocabulary probabilities
        for j, t in enumerate(ltids):
            assert probs[str(t)] == s["scores"][i][j] == m["results"][i]["label_probs"][j]
            lp = echo_logprobs(srv, q + ids(srv, item) + [t], len(q) + len(ids(srv, item)))[0]
            assert probs[str(t)] == math.exp(lp)
        assert sum(probs.values()) < 1.0


def test_item_order_and_the_prefix_cache_change_nothing(srv, smollm2_fp32):
    body = {"query": QUERY, "items": ITEMS, "labels": LABELS}
    cold = score(srv, "/v1/generative-scores", body)
    warm = score(srv, "/v1/generative-scores", body)
    back = score(srv, "/v1/generative-scores", {**body, "items": ITEMS[::-1]})
    off = LiveServer(smollm2_fp32, {"enable_prefix_cache": False, "max_queue_len": 256},
                     served_model_name=srv.model)
    try:
        uncached = score(off, "/v1/generative-scores", body)
        assert off.wait_idle()["kv_blocks_used"] == 0
    finally:
        off.close()
    for i in range(len(ITEMS)):
        a = cold["results"][i]["labels"]
        for other in (warm["results"][i], back["results"][len(ITEMS) - 1 - i],
                      uncached["results"][i]):
            for la, lb in zip(a, other["labels"]):
                assert la == lb
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > \
        cold["usage"]["prompt_tokens_details"]["cached_tokens"] - 1


def test_token_id_query_items_and_item_first(srv):
    q = ids(srv, QUERY)
    items = [ids(srv, it) for it in ITEMS[:3]]
    labels = [ids(srv, lab) for lab in LABELS[:2]]
    body = score(srv, "/v1/score", {"query": q, "items": items, "labels": labels,
                                    "item_first": True, "apply_softmax": True})
    for i, item in enumerate(items):
        for j, lab in enumerate(labels):
            got = body["labels"][i][j]
            prompt = item + q  # item first; ids are used exactly, nothing added
            want = echo_logprobs(srv, prompt + lab, len(prompt))
            assert got["token_logprobs"] == want
        assert math.isclose(sum(body["scores"][i]), 1.0, rel_tol=1e-12)


def test_peer_doc_bodies_work(srv):
    yes, no = ids(srv, " Yes")[0], ids(srv, " No")[0]
    # vLLM's docs and tests (the older protocol's sampling defaults included)
    vllm = {"query": "Is the following city the capital of France? ",
            "items": ["Paris", "London", "Berlin"], "label_token_ids": [yes, no],
            "apply_softmax": True, "item_first": False, "temperature": 0.0, "top_k": 0,
            "top_p": 1.0, "add_special_tokens": True, "priority": 0, "request_id": "abc"}
    g = score(srv, "/v1/generative-scores", vllm)
    assert g["id"] == "generative-score-abc" and [r["index"] for r in g["results"]] == [0, 1, 2]
    for r in g["results"]:
        assert math.isclose(sum(r["token_probs"].values()), 1.0, rel_tol=1e-9)
    # SGLang's docs: one string item, token-id items, apply_softmax
    sgl = score(srv, "/v1/score", {"query": "I love this", "items": " movie",
                                   "label_token_ids": [yes, no], "apply_softmax": True})
    assert len(sgl["scores"]) == 1 and len(sgl["scores"][0]) == 2
    sgl = score(srv, "/v1/score", {"query": [1, 2, 3], "items": [[4, 5], [6]],
                                   "label_token_ids": [yes, no, yes]})
    assert [len(s) for s in sgl["scores"]] == [3, 3] and sgl["scores"][0][0] == sgl["scores"][0][2]


@pytest.mark.parametrize("body,param,fragment", [
    ({"query": "q", "items": [[1, 2], [3, 4, 5, 6, 7, "x"]], "label_token_ids": [1]},
     "items[1][5]", "items[1][5] is not an integer token id"),
    ({"query": "q", "items": ["a"], "labels": [" yes", []]}, "labels[1]", "labels[1]"),
    ({"query": "q", "items": ["a"], "labels": [" yes", ""]}, "labels[1]", "labels[1] is empty"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items", "at least one item"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids", "at least one"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1, 99999999]}, "label_token_ids[1]",
     "outside the vocabulary"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "labels": ["b"]}, "labels",
     "exclusive"),
    ({"query": "q", "items": ["a"]}, "label_token_ids", "required"),
    ({"query": "q", "items": ["a", [1]], "label_token_ids": [1]}, "items", "all strings"),
    ({"query": [1, -1], "items": ["a"], "label_token_ids": [1]}, "query[1]",
     "outside the vocabulary"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "temperature": 0.7}, "temperature",
     "temperature is not supported"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "n": 2}, "n",
     "Unrecognized request argument supplied: n"),
    ({"query": [], "items": [[]], "label_token_ids": [1]}, "items[0]", "both empty"),
    ({"query": [5] * 600, "items": [[1]], "label_token_ids": [1]}, "max_tokens", "items[0]"),
    ({"query": "q", "items": ["a"] * 300, "labels": [" a b", " c d", " e f", " g h"]}, "items",
     "1 + 300 x 5"),
])
def test_refusals_name_field_and_position(srv, body, param, fragment):
    for path in ("/v1/generative-scores", "/v1/score"):
        if path == "/v1/score" and param in ("temperature",):
            param_, fragment_ = "temperature", "Unrecognized request argument"
        else:
            param_, fragment_ = param, fragment
        err = error_of(srv.post(path, body))
        assert err["param"] == param_ and fragment_ in err["message"], (path, err)


def test_wrong_model_is_404_and_metrics_count_scores(srv):
    error_of(srv.post("/v1/score", {"model": "other", "query": "q", "items": ["a"],
                                    "label_token_ids": [1]}), 404)
    score(srv, "/v1/score", {"query": "q", "items": ["a", "b"], "label_token_ids": [1, 2]})
    text = srv.http.get("/metrics").text
    assert 'freetoken_scored_items_total{route="score"}' in text
    assert 'freetoken_scored_labels_total{route="score"}' in text


def test_tiny_checkpoint_against_transformers(tiny_checkpoint):
    import torch

    from freetoken.loader import load_model

    path, ref = tiny_checkpoint("qwen2")
    loaded = load_model(path, dtype=torch.float32, device="cpu", load_tokenizer=False,
                        progress=False)
    srv = LiveServer(loaded, {"max_model_len": 64})
    try:
        query, items, labels = [5, 6, 7, 8, 9, 10, 11], [[20, 21], [30], [40, 41, 42]], \
            [[50], [60, 61], [70, 71, 72]]
        body = score(srv, "/v1/generative-scores", {"query": query, "items": items,
                                                    "labels": labels})
        for i, item in enumerate(items):
            for j, lab in enumerate(labels):
                seq = query + item + lab
                with torch.no_grad():
                    logits = ref(torch.tensor([seq])).logits[0].double()
                lps = torch.log_softmax(logits, -1)
                start = len(query) + len(item)
                want = [lps[p - 1, seq[p]].item() for p in range(start, len(seq))]
                got = body["results"][i]["labels"][j]["token_logprobs"]
                assert all(abs(a - b) <= 1e-4 for a, b in zip(got, want)), (i, j, got, want)
        assert srv.wait_idle()["kv_blocks_used"] == 0
    finally:
        srv.close()
