"""Schemathesis against FreeToken's own /openapi.json (issue 7): bodies generated from the
published request schemas of the generation and scoring routes, sent to the in-process
server of test_reliability. Check: no 500 and every answer is the OpenAI error shape with a
documented status or a valid completion (test_fuzz.check_response). Skipped when schemathesis is
not installed.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from test_fuzz import check_response  # noqa: E402

from freetoken.testing.live import LiveServer  # noqa: E402

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def st_srv(smollm2_fp32):
    import torch

    torch.set_num_threads(1)
    # the deadline bounds a schema-valid body that asks for a long generation (504 is documented)
    s = LiveServer(smollm2_fp32, engine=dict(max_num_seqs=16), request_timeout_s=5)
    yield s
    s.close()


def check_scoring(r) -> None:
    """A scoring answer: the peer's shape on 200, else a documented error in the OpenAI shape."""
    assert r.status_code in (200, 400, 404, 413, 503, 504), (r.status_code, r.text[:300])
    body = r.json()
    if r.status_code == 200:
        assert ("results" in body) != ("scores" in body), body
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions",
                                  "/v1/generative-scores", "/v1/score"])
def test_openapi_bodies(st_srv, path):
    # NOTE: schemathesis is used as the case generator over the published schema; the cases run
    # inside one plain test (its pytest integration, from_fixture + subtests, hung here)
    doc = st_srv.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc).include(path_regex=f"^{path}$")
    (op,) = [r.ok() for r in schema.get_all_operations()]
    statuses: dict[int, int] = {}

    @settings(
        max_examples=80,
        phases=[Phase.explicit, Phase.generate],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy())
    def run(case):
        body = case.body
        if isinstance(body, dict) and not {"max_tokens", "max_completion_tokens"} & set(body):
            body["max_tokens"] = 4  # NOTE: a chat default runs to the context's end: CI time
        r = case.call(base_url=st_srv.url, timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if "score" in path:
            check_scoring(r)
        else:
            check_response(r, chat="chat" in path)

    run()
    assert sum(statuses.values()) >= 40, statuses
