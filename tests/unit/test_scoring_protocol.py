"""protocol/scoring.py without a model: the prompt rule (ids exact, specials only at the start),
the label arithmetic, the plan's sequence count and the shared root."""

from __future__ import annotations

import math

import pytest

from freetoken.api.scoring import shared_prefix_len
from freetoken.errors import InvalidRequest
from freetoken.protocol.scoring import LabelScore, label_probs, parse_scoring

BOS = 1


class Limits:
    vocab_size = 1000
    max_model_len = 64


class Tok:
    """Each character is a token (ord % 900 + 10); BOS when asked."""

    def encode(self, text, add_special_tokens=True):
        return ([BOS] if add_special_tokens else []) + [ord(c) % 900 + 10 for c in text]


def plan(body, sglang=False):
    return parse_scoring(body, Limits(), Tok(), sglang=sglang)


def test_special_tokens_open_the_prompt_only():
    p = plan({"query": "ab", "items": ["c", "de"], "labels": [" x", "yz"]})
    assert p.prompts == [[BOS, 107, 108, 109], [BOS, 107, 108, 110, 111]]
    assert p.labels == [[42, 130], [131, 132]]  # labels never get BOS
    p = plan({"query": "ab", "items": ["c"], "label_token_ids": [5], "item_first": True})
    assert p.prompts == [[BOS, 109, 107, 108]]  # vLLM would put BOS before the query
    p = plan({"query": "ab", "items": ["c"], "label_token_ids": [5],
              "add_special_tokens": False})
    assert p.prompts == [[107, 108, 109]]
    p = plan({"query": [7, 8], "items": [[9]], "label_token_ids": [5, 6]})
    assert p.prompts == [[7, 8, 9]] and p.labels == [[5], [6]] and p.single_token
    # SGLang's /v1/score takes one string item too, and defaults apply_softmax to false
    p = plan({"query": "a", "items": "b", "label_token_ids": [5]}, sglang=True)
    assert p.prompts == [[BOS, 107, 108]] and not p.apply_softmax
    assert plan({"query": "a", "items": ["b"], "label_token_ids": [5]}).apply_softmax


def test_sequence_count_and_refusals():
    p = plan({"query": "a", "items": ["b", "c", "d"], "labels": ["xy", "z", "uvw"]})
    assert p.multi_token_labels == [0, 2] and p.num_sequences == 1 + 3 * 3
    with pytest.raises(InvalidRequest) as e:
        plan({"query": "a", "items": "b", "label_token_ids": [5]})  # a lone string: SGLang only
    assert e.value.param == "items"
    with pytest.raises(InvalidRequest) as e:
        plan({"query": "a" * 60, "items": ["bcd"], "labels": ["xyz"]})
    assert "items[0]" in e.value.message  # prompt + longest label past the context


def test_label_probs():
    scores = [LabelScore([1, 2], [-1.0, -0.5]), LabelScore([3], [-2.0]),
              LabelScore([4], [-math.inf])]
    assert scores[0].logprob == -1.5
    probs = label_probs(scores, apply_softmax=True)
    z = math.exp(-1.5) + math.exp(-2.0)
    assert probs == pytest.approx([math.exp(-1.5) / z, math.exp(-2.0) / z, 0.0], rel=1e-15)
    assert label_probs(scores, apply_softmax=False) == [math.exp(-1.5), math.exp(-2.0), 0.0]
    assert label_probs(scores[2:], apply_softmax=True) == [0.0]


def test_shared_prefix_leaves_every_item_a_token_of_its_own():
    assert shared_prefix_len([[1, 2, 3]]) == 0
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert shared_prefix_len([[1, 2], [3, 2]]) == 0
