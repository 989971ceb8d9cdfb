"""freetoken/engine/sampler.py: the logprob and rank of each row's token against a torch reference
(log-softmax of the masked, biased logits; rank = 1 + the number strictly greater), for greedy
rows (taken from the top list, no pass over the vocabulary) and sampled ones alike."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.sampler import Sampler, SampleRow
from freetoken.engine.sampling_params import SamplingParams


def _reference(logits: torch.Tensor, p: SamplingParams, token: int) -> tuple[float, int]:
    row = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    if p.allowed_token_ids is not None:
        keep = torch.full_like(row, float("-inf"))
        keep[p.allowed_token_ids] = row[p.allowed_token_ids]
        row = keep
    lp = torch.log_softmax(row, -1)
    return float(lp[token]), 1 + int((row > row[token]).sum())


@pytest.mark.parametrize("params", [
    dict(temperature=0, logprobs=2),
    dict(temperature=0, logprobs=0),
    dict(temperature=0, logprobs=3, allowed_token_ids=[5, 17, 99, 1000]),
    dict(temperature=0, logprobs=1, logit_bias={7: 30.0}),
    dict(temperature=0, logprobs=1, logprob_token_ids=[3, 4]),
    dict(temperature=1.0, seed=3, logprobs=2),
    dict(temperature=0.7, seed=5, logprobs=2, allowed_token_ids=[1, 2, 3, 4, 5, 6]),
])
def test_token_logprob_and_rank_match_the_reference(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2000, generator=g) * 3
    p = SamplingParams(max_tokens=1, **params)
    rows = [SampleRow(p, 11 + r, 0, [1, 2], 2) for r in range(logits.shape[0])]
    for r, (token, lp) in enumerate(Sampler("cpu").sample(logits, rows)):
        want_lp, want_rank = _reference(logits[r], p, token)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(want_lp, abs=2e-5)
        assert lp.rank == want_rank
        if p.greedy:  # the token is a max of the masked, biased logits
            assert want_rank == 1
        assert [t for t, _ in lp.extra] == list(p.logprob_token_ids or [])
        for t, v in lp.extra:
            assert v == pytest.approx(_reference(logits[r], p, t)[0], abs=2e-5)
