"""freetoken.protocol without a model: request validation, every refusal, and the response builders.

A byte-level fake tokenizer (ids 0..255 are bytes, 256 BOS, 257 EOS) keeps these tests exact and
fast; the same refusals are checked over HTTP against SmolLM2 in test_server.py.

One file, as freetoken.protocol is one contract: each refusal beside the rule it checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from freetoken.config import ServerConfig
from freetoken.engine.sampling_params import SamplingParams
from freetoken.errors import ContextTooLong, InvalidRequest
from freetoken.protocol import limits, responses
from freetoken.protocol.parse import parse_chat, parse_completion
from freetoken.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    neutral_only_fields,
)


class FakeTokenizer:
    vocab_size = 300
    bos_token_id, eos_token_id = 256, 257
    bos_token, eos_token = "<s>", "</s>"
    chat_template = "fake"

    def __init__(self, add_bos_token: bool = False):
        self.add_bos_token = add_bos_token

    def encode(self, text, add_special_tokens=True):
        ids = list(text.encode())
        return ([self.bos_token_id] if self.add_bos_token and add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens=True):
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
            elif not skip_special_tokens:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append({256: "<s>", 257: "</s>"}.get(t, f"<{t}>"))
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def token_bytes(self, t):
        return bytes([t]) if t < 256 else self.decode([t], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class Limits:
    vocab_size: int = 300
    max_model_len: int = 64
    max_logprobs: int = 20


@dataclass
class TL:  # TokenLogprob
    token_id: int
    logprob: float
    rank: int = 1
    top: list = field(default_factory=list)
    extra: list = field(default_factory=list)
    allowed_mass: float | None = None


@dataclass
class Out:  # RequestOutput
    new_token_ids: list
    new_text: str
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: object = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    request_id: str = "r"


TOK = FakeTokenizer()
LIM = Limits()


def parse(body, tok=TOK, **kw):
    kw.setdefault("max_batch_prompts", ServerConfig.max_batch_prompts)
    return parse_completion(body, LIM, tok, **kw)


def refused(body, param, message=None, fn=parse):
    with pytest.raises(InvalidRequest) as ei:
        fn(body)
    assert ei.value.param == param, (ei.value.param, ei.value.message)
    assert ei.value.status == 400
    if message is not None:
        assert ei.value.message == message, ei.value.message
    return ei.value


# ---- the seed refusals (seed document 001) -------------------------------------------------


def test_seed_refusals_exact():
    refused({"prompt": []}, "prompt", "prompt: an empty token-id array cannot be evaluated")
    refused({"prompt": [1, "2"]}, "prompt[1]", "prompt[1] is not an integer token id")
    refused(
        {"prompt": [999999999]},
        "prompt[0]",
        "prompt[0] = 999999999 is outside the vocabulary (0..299)",
    )
    refused({"prompt": {"a": 1}}, "prompt", "prompt must be a string or an array of token ids")


@pytest.mark.parametrize(
    "prompt,param",
    [
        ([[]], "prompt[0]"),
        ([[1, 2], []], "prompt[1]"),
        ([1, True], "prompt[1]"),
        ([2.5], "prompt[0]"),
        ([1.0], "prompt[0]"),
        ([[1, 2], [3, "4"]], "prompt[1][1]"),
        ([[1], [2, 300]], "prompt[1][1]"),
        ([-1], "prompt[0]"),
        (["a", 1], "prompt[1]"),
        ([[1], 2], "prompt[1]"),
        ([1, [2]], "prompt[1]"),
        (["a", ""], "prompt[1]"),
        ("", "prompt"),
        (5, "prompt"),
        (None, "prompt"),
        (True, "prompt"),
        ([None], "prompt[0]"),
    ],
)
def test_prompt_refusals_name_position(prompt, param):
    e = refused({"prompt": prompt}, param)
    assert param in e.message


def test_prompt_missing():
    refused({}, "prompt", "prompt is required")


def test_prompt_forms():
    p = parse({"prompt": "ab"})
    assert [x.ids for x in p.prompts] == [[97, 98]]
    p = parse({"prompt": "ab"}, tok=FakeTokenizer(add_bos_token=True))
    assert [x.ids for x in p.prompts] == [[256, 97, 98]]
    p = parse({"prompt": "ab", "add_special_tokens": False}, tok=FakeTokenizer(add_bos_token=True))
    assert [x.ids for x in p.prompts] == [[97, 98]]
    # id prompts are used exactly, BOS or not
    p = parse({"prompt": [1, 256, 3]}, tok=FakeTokenizer(add_bos_token=True))
    assert [x.ids for x in p.prompts] == [[1, 256, 3]]
    p = parse({"prompt": [[1], [2, 3]]})
    assert [x.ids for x in p.prompts] == [[1], [2, 3]]
    p = parse({"prompt": ["a", "bc"]})
    assert [x.ids for x in p.prompts] == [[97], [98, 99]]


def test_max_batch_prompts():
    refused({"prompt": [[1]] * 3}, "prompt", fn=lambda b: parse(b, max_batch_prompts=2))
    parse({"prompt": [[1]] * 2}, max_batch_prompts=2)


def test_context_too_long():
    with pytest.raises(ContextTooLong) as ei:
        parse({"prompt": [1] * 60, "max_tokens": 5})
    assert ei.value.message == (
        "You passed 60 input tokens and requested 5 output tokens; the context is 64"
    )
    assert ei.value.param == "max_tokens"
    parse({"prompt": [1] * 60, "max_tokens": 4})
    with pytest.raises(ContextTooLong) as ei:
        parse({"prompt": [[1], [1] * 64], "max_tokens": 1})
    assert ei.value.message.startswith("prompt[1]: You passed 64 input tokens")


# ---- fields --------------------------------------------------------------------------------


def test_unknown_field():
    refused({"prompt": "a", "foo": 1}, "foo", "Unrecognized request argument supplied: foo")
    refused(
        {"prompt": "a", "stream_options": {"x": 1}},
        "stream_options.x",
        "Unrecognized request argument supplied: stream_options.x",
    )


@pytest.mark.parametrize(
    "name,value",
    [
        ("best_of", 2),
        ("use_beam_search", True),
        ("suffix", "x"),
        ("guided_json", {}),
        ("guided_regex", "a+"),
        ("guided_choice", ["a"]),
        ("guided_grammar", "g"),
        ("structured_outputs", {"json": {}}),
        ("response_format", {"type": "json_object"}),
        ("prompt_embeds", "abc"),
        ("truncate_prompt_tokens", 5),
        ("length_penalty", 2.0),
        ("bad_words", ["x"]),
        ("spaces_between_special_tokens", False),
    ],
)
def test_unimplemented_fields_refused(name, value):
    refused({"prompt": "a", name: value}, name, f"{name} is not supported")


@pytest.mark.parametrize(
    "name,value",
    [
        ("best_of", 1),
        ("use_beam_search", False),
        ("suffix", None),
        ("suffix", ""),
        ("guided_json", None),
        ("response_format", {"type": "text"}),
        ("logit_bias", {}),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0),
        ("repetition_penalty", 1.0),
        ("user", "me"),
        ("prompt_embeds", None),
        ("truncate_prompt_tokens", None),
    ],
)
def test_neutral_values_accepted(name, value):
    parse({"prompt": "a", name: value})


def test_neutral_only_fields_are_read_off_the_models():
    comp = neutral_only_fields(CompletionRequest)
    chat_fields = neutral_only_fields(ChatCompletionRequest)
    assert comp["best_of"] == (None, 1) and comp["suffix"] == (None, "")
    assert chat_fields["tools"] == (None, []) and chat_fields["tool_choice"] == (None, "none")
    assert "suffix" not in chat_fields and "tools" not in comp
    for model, neutral in ((CompletionRequest, comp), (ChatCompletionRequest, chat_fields)):
        # the declaration and its documentation agree, and the default is a neutral value
        described = {
            name
            for name, info in model.model_fields.items()
            if (info.description or "").startswith("neutral only")
        }
        assert set(neutral) == described
        for name, values in neutral.items():
            assert model.model_fields[name].default in values, name


@pytest.mark.parametrize("name", sorted(neutral_only_fields(CompletionRequest)))
def test_every_neutral_only_field_is_refused_otherwise(name):
    neutral = neutral_only_fields(CompletionRequest)[name]
    for value in neutral:
        parse({"prompt": "a", name: value})
    unsupported = 0
    for value in (True, False, 7, 7.5, "x", {"a": 1}, ["x"]):
        if value in neutral:
            continue
        with pytest.raises(InvalidRequest) as ei:  # a wrong type, or "not supported"
            parse({"prompt": "a", name: value})
        assert ei.value.param == name
        unsupported += ei.value.message == f"{name} is not supported"
    assert unsupported


def test_shared_limits_name_the_field_in_sampling_params_and_engine():
    # SamplingParams raises the protocol's InvalidRequest (a ValueError too) for the shared rules
    with pytest.raises(ValueError) as ei:
        SamplingParams(stop_token_ids=[3, -1])
    assert isinstance(ei.value, InvalidRequest) and ei.value.param == "stop_token_ids[1]"
    with pytest.raises(InvalidRequest, match=r"min_tokens \(5\) is greater than max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidRequest, match="requires logprobs"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(logit_bias={"x": 1.0})
    assert ei.value.param == "logit_bias.x"
    assert SamplingParams(logit_bias={"5": 1.0, 6: 0.0}).logit_bias == {5: 1.0}
    # the engine's check: the same messages the protocol gives
    params = SamplingParams(max_tokens=5, logprobs=21, allowed_token_ids=[1, 300])
    with pytest.raises(InvalidRequest) as ei:
        limits.check_request([1, 2], params, LIM)
    assert ei.value.message == "Requested logprobs of 21, which is greater than max allowed: 20"
    params = SamplingParams(max_tokens=5, allowed_token_ids=[1, 300])
    with pytest.raises(InvalidRequest) as ei:
        limits.check_request([1, 2], params, LIM)
    assert ei.value.param == "allowed_token_ids[1]"
    assert ei.value.message == "allowed_token_ids[1] = 300 is outside the vocabulary (0..299)"
    with pytest.raises(ContextTooLong) as ei:
        limits.check_request([1] * 60, SamplingParams(max_tokens=5), LIM)
    assert ei.value.message == (
        "You passed 60 input tokens and requested 5 output tokens; the context is 64"
    )
    with pytest.raises(InvalidRequest) as ei:
        limits.check_request([1, 300], SamplingParams(), LIM)
    assert ei.value.message == "prompt[1] = 300 is outside the vocabulary (0..299)"
    limits.check_request([1, 299], SamplingParams(max_tokens=62, logprobs=20), LIM)


def test_peer_behaviours_re_expressed():
    # vLLM's test_logprob_token_ids / serving tests and OpenAI's refusals, against this contract
    for lp in (None, 1):  # vLLM: an empty list is refused whatever logprobs says
        body = {"prompt": "a", "logprob_token_ids": []} | ({"logprobs": lp} if lp else {})
        refused(body, "logprob_token_ids", "logprob_token_ids must not be empty")
    refused(
        {"prompt": "a", "logprob_token_ids": [5]},
        "logprob_token_ids",
        "logprob_token_ids requires logprobs to be set",
    )
    # stream_options is for streams (vLLM: "Stream options can only be defined when
    # `stream=True`"); null is no options at all, and with stream: true it is served
    msg = "stream_options is only allowed when stream is true"
    refused({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", msg)
    refused({"prompt": "a", "stream": False, "stream_options": {}}, "stream_options", msg)
    assert not parse({"prompt": "a", "stream_options": None}).include_usage
    assert parse(
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    ).include_usage
    m = [{"role": "user", "content": "a"}]
    refused(
        {"messages": m, "stream_options": {"include_usage": True}}, "stream_options", msg, fn=chat
    )
    # every bad logit_bias entry in one 400, in the body's order (vLLM lists every bad id)
    e = refused(
        {"prompt": "a", "logit_bias": {"300": 1, "7": 2, "x": 1, "5": 101, "-1": 0}},
        "logit_bias.300, logit_bias.x, logit_bias.5, logit_bias.-1",
    )
    assert e.message == (
        "logit_bias.300: token id 300 is outside the vocabulary (0..299); "
        "logit_bias.x: the key 'x' is not a token id; "
        "logit_bias.5 = 101.0 is outside [-100, 100]; "
        "logit_bias.-1: token id -1 is outside the vocabulary (0..299)"
    )
    refused(
        {"messages": m, "logit_bias": {"300": 1, "301": 1}},
        "logit_bias.300, logit_bias.301",
        fn=chat,
    )
    # one bad entry reads as before
    refused(
        {"prompt": "a", "logit_bias": {"7": 2, "300": 1}},
        "logit_bias.300",
        "logit_bias.300: token id 300 is outside the vocabulary (0..299)",
    )


def test_logit_bias_key_of_non_ascii_digits_is_a_400():
    # "²".isdigit() but int("²") fails: the key must be refused, not crash the request
    refused({"prompt": "a", "logit_bias": {"\u00b2": 1}}, "logit_bias.\u00b2")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop[1]"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop_token_ids": [1, 300]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 2, 300]}, "allowed_token_ids[2]"),
        ({"allowed_token_ids": [1, False]}, "allowed_token_ids[1]"),
        ({"allowed_token_ids": [1, 2.0]}, "allowed_token_ids[1]"),
        ({"logit_bias": {"300": 1}}, "logit_bias.300"),
        ({"logit_bias": {"x": 1}}, "logit_bias.x"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"logit_bias": {"5": True}}, "logit_bias.5"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": [300]}, "logprob_token_ids[0]"),
        ({"logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids"),
        ({"logprob_token_ids": []}, "logprob_token_ids"),
        ({"logprob_token_ids": "123"}, "logprob_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": float("nan")}, "temperature"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"seed": 2**63 - 1}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_p": 1e-300}, "top_p"),
        ({"temperature": 1e300}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ],
)
def test_field_refusals(body, param):
    refused({"prompt": "a", **body}, param)


def test_logprobs_cap_message():
    refused(
        {"prompt": "a", "logprobs": 21},
        "logprobs",
        "Requested logprobs of 21, which is greater than max allowed: 20",
    )
    parse({"prompt": "a", "logprobs": 20})


def test_not_an_object():
    with pytest.raises(InvalidRequest):
        parse([1, 2])


def test_sampling_params_built():
    p = parse(
        {
            "prompt": "a",
            "max_tokens": 3,
            "temperature": 0,
            "top_k": 0,
            "seed": 7,
            "stop": "x",
            "allowed_token_ids": [5, 3, 5],
            "logit_bias": {"4": -100},
            "logprobs": 2,
            "logprob_token_ids": [9],
            "n": 3,
            "ignore_eos": True,
        }
    )
    sp = p.params
    assert sp.max_tokens == 3 and sp.temperature == 0 and sp.top_k == -1 and sp.seed == 7
    assert sp.stop == ["x"] and sorted(sp.allowed_token_ids) == [3, 5]
    assert sp.logit_bias == {4: -100.0} and sp.logprobs == 2 and sp.logprob_token_ids == [9]
    assert sp.ignore_eos and p.n == 3
    assert [p.choice_params(j).seed for j in range(3)] == [7, 8, 9]
    assert p.prompt_logprobs is None and sp.prompt_logprobs is None


def test_echo_requests_prompt_logprobs():
    p = parse({"prompt": [1, 2], "echo": True, "logprobs": 3, "max_tokens": 0})
    assert p.score_only and p.params.max_tokens == 0 and p.params.prompt_logprobs == 3
    assert p.prompt_logprobs is None


# ---- chat ----------------------------------------------------------------------------------


def chat(body):
    return parse_chat(body, LIM, TOK)


def test_chat_logprob_token_ids():
    m = [{"role": "user", "content": "hi"}]
    p = chat({"messages": m, "logprobs": True, "logprob_token_ids": [9, 3, 9]})
    assert p.params.logprob_token_ids == [9, 3] and p.params.logprobs == 0
    for body, message in [
        ({"logprob_token_ids": [9]}, "logprob_token_ids requires logprobs to be true"),
        (
            {"logprobs": False, "logprob_token_ids": [9]},
            "logprob_token_ids requires logprobs to be true",
        ),
        ({"logprobs": True, "logprob_token_ids": []}, "logprob_token_ids must not be empty"),
        ({"logprob_token_ids": []}, "logprob_token_ids must not be empty"),
    ]:
        refused({"messages": m, **body}, "logprob_token_ids", message, fn=chat)
    refused(
        {"messages": m, "logprobs": True, "logprob_token_ids": [1, 300]},
        "logprob_token_ids[1]",
        "logprob_token_ids[1] = 300 is outside the vocabulary (0..299)",
        fn=chat,
    )
    refused(
        {"messages": m, "logprobs": True, "logprob_token_ids": list(range(257))},
        "logprob_token_ids",
        fn=chat,
    )


def test_chat_parse():
    p = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert p.prompts[0].ids == list(b"<user>hi\n<assistant>")
    assert p.params.logprobs == 2 and p.logprobs == 2
    p = chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert p.prompts[0].ids == list(b"<user>hi\n<assistant>")
    assert p.params.max_tokens == LIM.max_model_len - len(p.prompts[0].ids)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                ]
            },
            "messages[1].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "a", "x": 1}]}, "messages[0].x"),
        ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 100}, "max_tokens"),
    ],
)
def test_chat_refusals(body, param):
    refused(body, param, fn=chat)


# ---- responses -----------------------------------------------------------------------------


def test_legacy_logprobs_top_k_plus_sampled_and_offsets():
    p = parse({"prompt": [104, 105], "logprobs": 1, "max_tokens": 2})
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    f1 = st.feed(Out([120], "x", [TL(120, -2.0, 3, [(50, -0.1)])], num_cached_tokens=1))
    f2 = st.feed(
        Out(
            [121],
            "y",
            [TL(121, -0.5, 1, [(121, -0.5)])],
            finished=True,
            finish_reason="length",
            num_cached_tokens=1,
        )
    )
    m = responses.merge_fragments([f1, f2])
    lp = m.logprobs.to_dict()
    assert m.text == "xy" and m.finish_reason == "length"
    assert lp["tokens"] == ["x", "y"] and lp["token_logprobs"] == [-2.0, -0.5]
    assert lp["top_logprobs"] == [{"2": -0.1, "x": -2.0}, {"y": -0.5}]
    assert lp["text_offset"] == [0, 1]
    assert st.num_cached_tokens == 1 and st.num_output_tokens == 2


def test_token_id_keys_do_not_collide():
    p = parse({"prompt": [1], "logprobs": 2, "return_tokens_as_token_ids": True})
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    # 0xC3 and 0xC4 both decode to U+FFFD alone: text keys would collide
    f = st.feed(
        Out(
            [0xC3],
            "",
            [TL(0xC3, -0.7, 1, [(0xC3, -0.7), (0xC4, -0.8)])],
            finished=True,
            finish_reason="length",
        )
    )
    lp = f.logprobs.to_dict()
    assert lp["tokens"] == ["token_id:195"]
    assert lp["top_logprobs"] == [{"token_id:195": -0.7, "token_id:196": -0.8}]


def test_echo_logprobs_first_null():
    p = parse({"prompt": [104, 105, 106], "logprobs": 1, "echo": True, "max_tokens": 1})
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    plps = [None, TL(105, -1.0, 2, [(1, -0.5)]), TL(106, -2.0, 1, [(106, -2.0)])]
    f = st.feed(
        Out(
            [33],
            "!",
            [TL(33, -0.3, 1, [(33, -0.3)])],
            prompt_logprobs=plps,
            finished=True,
            finish_reason="length",
        )
    )
    lp = f.logprobs.to_dict()
    assert f.text == "hij!"
    assert lp["tokens"] == ["h", "i", "j", "!"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.3]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"\x01": -0.5, "i": -1.0}
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert f.prompt_logprobs is None


def test_score_only_drops_generated():
    p = parse(
        {"prompt": [104, 105], "logprobs": 0, "echo": True, "max_tokens": 0, "prompt_logprobs": 1}
    )
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    plps = [None, TL(105, -1.0, 2, [(1, -0.5)])]
    f = st.feed(
        Out(
            [33],
            "!",
            [TL(33, -0.3, 1, [])],
            prompt_logprobs=plps,
            finished=True,
            finish_reason="length",
        )
    )
    assert f.text == "hi" and st.num_output_tokens == 0
    assert f.logprobs.to_dict()["token_logprobs"] == [None, -1.0]
    assert f.prompt_logprobs == [
        None,
        {
            "1": {"logprob": -0.5, "rank": 1, "decoded_token": "\x01"},
            "105": {"logprob": -1.0, "rank": 2, "decoded_token": "i"},
        },
    ]


def test_utf8_offsets_real():
    # "é" is two bytes, two tokens: both tokens start at char 0; "x" at char 1
    p = parse({"prompt": [1], "logprobs": 0})
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    f = st.feed(Out([0xC3, 0xA9, 120], "éx", [TL(0xC3, -1), TL(0xA9, -1), TL(120, -1)]))
    assert f.logprobs.text_offset == [0, 0, 1]


def test_chat_logprobs_shape():
    p = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 1,
            "max_tokens": 2,
        }
    )
    st = responses.ChatChoiceState(TOK, p, p.prompts[0])
    f = st.feed(
        Out(
            [65],
            "A",
            [TL(65, -0.1, 1, [(65, -0.1), (66, -3.0)])],
            finished=True,
            finish_reason="stop",
        )
    )
    c = responses.chat_choice(0, f)
    assert c["message"] == {"role": "assistant", "content": "A"}
    assert c["logprobs"]["content"] == [
        {
            "token": "A",
            "logprob": -0.1,
            "bytes": [65],
            "top_logprobs": [{"token": "A", "logprob": -0.1, "bytes": [65]}],
        }
    ]
    assert c["finish_reason"] == "stop"


def test_chat_top_logprobs_carry_logprob_token_ids():
    p = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 1,
            "logprob_token_ids": [66, 65, 90],
        }
    )
    st = responses.ChatChoiceState(TOK, p, p.prompts[0])
    f = st.feed(
        Out(
            [65],
            "A",
            [TL(65, -0.1, 1, [(65, -0.1), (66, -3.0)], [(66, -3.0), (65, -0.1), (90, -7.5)])],
        )
    )
    (entry,) = f.logprobs
    # the top 1, then every requested id once, best first; no allowed_logprob without a set
    assert [(e["token"], e["logprob"]) for e in entry["top_logprobs"]] == [
        ("A", -0.1),
        ("B", -3.0),
        ("Z", -7.5),
    ]
    assert "allowed_logprob" not in entry


def test_allowed_logprobs_rendered_with_allowed_token_ids_only():
    body = {
        "prompt": [104, 105],
        "logprobs": 1,
        "echo": True,
        "max_tokens": 2,
        "allowed_token_ids": [33, 34],
    }
    p = parse(body)
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    plps = [None, TL(105, -1.0, 2, [(1, -0.5)])]
    f1 = st.feed(Out([33], "!", [TL(33, -0.3, 1, [(33, -0.3)], [], -2.5)], prompt_logprobs=plps))
    f2 = st.feed(
        Out(
            [34],
            '"',
            [TL(34, -0.9, 2, [(33, -0.5)], [], -0.25)],
            finished=True,
            finish_reason="length",
        )
    )
    assert f1.logprobs.to_dict()["allowed_logprobs"] == [None, None, -2.5]  # prompt: null
    assert f2.logprobs.to_dict()["allowed_logprobs"] == [-0.25]  # each chunk carries its own
    lp = responses.merge_fragments([f1, f2]).logprobs.to_dict()
    assert lp["allowed_logprobs"] == [None, None, -2.5, -0.25]
    assert len(lp["allowed_logprobs"]) == len(lp["token_logprobs"])
    # score only: every position is a prompt position
    p = parse({**body, "max_tokens": 0})
    f = responses.ChoiceState(TOK, p, p.prompts[0]).feed(
        Out([], "", None, prompt_logprobs=plps, finished=True, finish_reason="length")
    )
    assert f.logprobs.to_dict()["allowed_logprobs"] == [None, None]
    # without allowed_token_ids the key is absent
    p = parse({"prompt": [104], "logprobs": 1})
    f = responses.ChoiceState(TOK, p, p.prompts[0]).feed(Out([33], "!", [TL(33, -0.3)]))
    assert "allowed_logprobs" not in f.logprobs.to_dict()
    # chat: one allowed_logprob per content entry
    p = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "allowed_token_ids": [65, 66],
        }
    )
    f = responses.ChatChoiceState(TOK, p, p.prompts[0]).feed(
        Out([65], "A", [TL(65, -0.1, 1, [], [], -1.75)])
    )
    assert f.logprobs == [
        {"token": "A", "logprob": -0.1, "bytes": [65], "top_logprobs": [], "allowed_logprob": -1.75}
    ]


def test_minus_inf_logprobs_render_as_openais_stand_in():
    # an id outside allowed_token_ids asked for through logprob_token_ids has logprob -inf;
    # JSON has no -inf, so it renders as -9999.0 (OpenAI's and vLLM's value), never a 500
    import json

    inf = float("-inf")
    p = parse(
        {
            "prompt": [104],
            "logprobs": 1,
            "logprob_token_ids": [5],
            "allowed_token_ids": [33],
            "return_tokens_as_token_ids": True,
        }
    )
    st = responses.ChoiceState(TOK, p, p.prompts[0])
    f = st.feed(Out([33], "!", [TL(33, 0.0, 1, [(33, 0.0)], [(5, inf)], -1.5)]))
    lp = f.logprobs.to_dict()
    assert lp["top_logprobs"] == [{"token_id:33": 0.0, "token_id:5": -9999.0}]
    json.dumps(lp, allow_nan=False)
    p = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "logprob_token_ids": [5],
            "allowed_token_ids": [33],
        }
    )
    f = responses.ChatChoiceState(TOK, p, p.prompts[0]).feed(
        Out([33], "!", [TL(33, inf, 1, [], [(5, inf)], -1.5)])
    )
    (entry,) = f.logprobs
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["logprob"] == -9999.0
    json.dumps(entry, allow_nan=False)


def test_usage_dict():
    u = responses.usage_dict(5, 2, 3)
    assert u == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_openapi_schemas_are_the_models():
    from freetoken.api.openapi import openapi_document

    doc = openapi_document()
    comp = doc["components"]["schemas"]["CompletionRequest"]
    assert comp["additionalProperties"] is False
    assert {"prompt", "allowed_token_ids", "logprobs", "echo"} <= set(comp["properties"])
    assert "prompt" in comp["required"]
    # the logprobs objects of the 200 bodies carry the allowed-set mass (docs/api.md)
    schemas = doc["components"]["schemas"]
    assert "allowed_logprobs" in schemas["CompletionLogprobs"]["properties"]
    assert "allowed_logprob" in schemas["ChatCompletionTokenLogprob"]["properties"]
    for path, name in (("/v1/completions", "CompletionResponse"),
                       ("/v1/chat/completions", "ChatCompletionResponse")):  # fmt: skip
        ok = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"]["$ref"] == f"#/components/schemas/{name}"
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and all(r.startswith("#/components/schemas/") for r in refs)
    assert all(r.rsplit("/", 1)[1] in doc["components"]["schemas"] for r in refs)
    assert not math.isnan(len(doc["paths"]))
