"""The official `openai` Python client against the real server (completions and chat, streamed
and not, errors). Shares test_server.py's uvicorn thread and engine."""

from __future__ import annotations

import math

import pytest
from test_server import MODEL, NO, QUESTION, YES, get_server, same_logprobs

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def client():
    srv = get_server()
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_completion(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text
    assert len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) >= 2
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 5


def test_completion_scoring_extras(client):
    r = client.completions.create(
        model=MODEL,
        prompt=QUESTION,
        max_tokens=1,
        temperature=0,
        logprobs=2,
        extra_body={"allowed_token_ids": [YES, NO], "return_tokens_as_token_ids": True},
    )
    top = r.choices[0].logprobs.top_logprobs[0]
    assert set(top) == {f"token_id:{YES}", f"token_id:{NO}"}
    assert abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-4


def test_completion_ids_prompt(client):
    r = client.completions.create(
        model=MODEL, prompt=[[1, 9690, 198], [4182, 260]], max_tokens=2, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 5


def test_completion_stream(client):
    kw = dict(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=1)
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == full.choices[0].logprobs.tokens


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert len(c.logprobs.content) == r.usage.completion_tokens
    e = c.logprobs.content[0]
    assert isinstance(e.bytes, list) and len(e.top_logprobs) == 2
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [
        e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert same_logprobs(streamed, [e.logprob for e in full.choices[0].logprobs.content])
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_errors_map_to_client_exceptions(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=[1, "2"], max_tokens=1)
    assert ei.value.body["param"] == "prompt[1]"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert [m.id for m in client.models.list()] == [MODEL]
