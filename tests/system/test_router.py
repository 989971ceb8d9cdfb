"""Two real FreeToken replicas (`python -m freetoken` subprocesses) behind vllm-router 0.1.17 on
loopback, started and stopped by `freetoken.cluster.Cluster` (issue 8, docs/scale-out.md).

What these show:
- every prompt form (text, list[int], list[list[int]], list[str]) and chat answers 200 through
  the router with exactly the output a replica gives directly; our 400 for `[]` passes through;
- prefix affinity with the `cache_aware` policy, for text and for token-id prompts: 3 groups of
  20 requests sharing a 200-token prefix each land (>= 95 %) on one replica, both replicas are
  used, and every request after a group's first is served from the prefix cache;
- killing a replica mid-run: the router's health check drops it, every later request succeeds,
  every call is bounded by a timeout.

Which replica served a request: the response `id` is `cmpl-<replica request id>`, and each
replica logs that id in its one line per request (the router passes the body through, but not the
replica's `X-Request-Id` header).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import shutil
import threading
import time

import httpx
import pytest

from freetoken.cluster import Cluster

pytestmark = pytest.mark.real_model

MODEL = "smol"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
GROUPS, PER_GROUP, PREFIX_TOKENS = 3, 20, 200
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega river stone cloud lantern copper meadow"
).split()


def _have_router() -> bool:
    if shutil.which("vllm-router"):
        return True
    try:
        import vllm_router  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not _have_router():
        pytest.fail("vllm-router is not installed: pip install vllm-router==0.1.17")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    c = Cluster(
        2,
        policy="cache_aware",
        replica_args=[
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "48MiB",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
        ],
        log_dir=tmp_path_factory.mktemp("cluster"),
        env=env,
        startup_timeout=240,
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()
    for proc in [c.router, *c.replicas]:
        assert proc.poll() is not None, "a cluster process survived stop()"


@pytest.fixture(scope="module")
def router(cluster):
    with httpx.Client(base_url=cluster.router_url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def direct(cluster):
    with httpx.Client(base_url=cluster.replica_urls[1], timeout=TIMEOUT) as client:
        yield client


def served_by(cluster, response_id: str, deadline_s: float = 10.0) -> int:
    """The replica whose log holds this request's id (the line is written after the body)."""
    rid = response_id.split("-", 1)[1]
    deadline = time.monotonic() + deadline_s
    while True:
        found = [
            i
            for i in range(len(cluster.replicas))
            if rid in (cluster.log_dir / f"replica{i}.log").read_text(errors="replace")
        ]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, (response_id, found)
            return found[0]
        time.sleep(0.1)


def texts(body: dict) -> list:
    return [c.get("text", c.get("message")) for c in body["choices"]]


# ---- every prompt form -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [
        "The capital of France is",
        [1, 9690, 198, 2683, 359, 253, 5356, 5646],
        [[1, 9690, 198], [2683, 359, 253, 5356]],
        ["Hello, my name is", "The weather today"],
    ],
    ids=["text", "list[int]", "list[list[int]]", "list[str]"],
)
def test_prompt_forms_through_the_router(router, direct, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    via, ref = router.post("/v1/completions", json=body), direct.post("/v1/completions", json=body)
    assert via.status_code == 200, via.text
    assert ref.status_code == 200, ref.text
    n = len(prompt) if isinstance(prompt[0], (str, list)) and not isinstance(prompt, str) else 1
    assert len(via.json()["choices"]) == n
    assert texts(via.json()) == texts(ref.json())
    assert via.json()["usage"]["prompt_tokens"] == ref.json()["usage"]["prompt_tokens"]


def test_chat_through_the_router(router, direct):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    via, ref = (
        router.post("/v1/chat/completions", json=body),
        direct.post("/v1/chat/completions", json=body),
    )
    assert via.status_code == 200, via.text
    assert via.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    for key in ("prompt_tokens", "completion_tokens"):  # cached_tokens differ: other replica
        assert via.json()["usage"][key] == ref.json()["usage"][key]


def test_streaming_through_the_router(router, direct):
    body = {"model": MODEL, "prompt": [1, 9690, 198, 2683, 359], "max_tokens": 8, "temperature": 0}
    ref = direct.post("/v1/completions", json=body).json()["choices"][0]["text"]
    chunks = []
    with router.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            if line == "data: [DONE]":
                break
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref


def test_empty_prompt_list_is_our_400_passed_through(router, direct):
    body = {"model": MODEL, "prompt": [], "max_tokens": 4}
    via, ref = router.post("/v1/completions", json=body), direct.post("/v1/completions", json=body)
    assert via.status_code == ref.status_code == 400
    assert via.json() == ref.json()
    assert via.json()["error"]["param"] == "prompt"
    assert "empty token-id array" in via.json()["error"]["message"]


def test_unknown_model_is_our_404_passed_through(router):
    r = router.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"] == "The model `nope` does not exist."


# ---- prefix affinity -------------------------------------------------------------------------


def _prefix_ids(direct, seed: int) -> list[int]:
    rnd = random.Random(seed)
    text = " ".join(rnd.choice(WORDS) for _ in range(PREFIX_TOKENS * 2))
    ids = direct.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
        "tokens"
    ]
    assert len(ids) >= PREFIX_TOKENS
    return ids[:PREFIX_TOKENS]


# NOTE: long enough that a group's first request is still decoding when the next group's first
# one arrives 0.3 s later, however fast the machine: 16 tokens (and EOS could come sooner) were
# done in ~0.15 s on a quiet Zen 5, the router then saw both replicas idle and sent every new
# prefix to replica 0.
FIRST_TOKENS = 96


def _run_groups(cluster, router, prompts) -> list[list[tuple[int, int]]]:
    """prompts[g][i] -> [(replica, cached_tokens)] per group. Each group's first request goes out
    0.3 s after the previous group's, while it is still being computed: the router sees that
    replica busy and sends the next new prefix to the other one (cache_aware routes an unmatched
    prefix to the least-loaded replica). Then the rounds go out, the 3 groups concurrently."""

    def send(g, i, max_tokens):
        r = router.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompts[g][i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,  # the first request's length is max_tokens, never cut short
            },
        )
        assert r.status_code == 200, r.text
        j = r.json()
        return served_by(cluster, j["id"]), j["usage"]["prompt_tokens_details"]["cached_tokens"]

    out = [[] for _ in range(GROUPS)]
    with cf.ThreadPoolExecutor(GROUPS) as pool:
        firsts = []
        for g in range(GROUPS):
            firsts.append(pool.submit(send, g, 0, FIRST_TOKENS))
            time.sleep(0.3)
        for g, f in enumerate(firsts):
            out[g].append(f.result(timeout=120))
        for i in range(1, PER_GROUP):
            for g, res in enumerate(pool.map(lambda g: send(g, i, 1), range(GROUPS))):
                out[g].append(res)
    return out


def _check_affinity(groups: list[list[tuple[int, int]]]) -> None:
    homes = []
    for g, rows in enumerate(groups):
        replicas = [r for r, _ in rows]
        home = max(set(replicas), key=replicas.count)
        homes.append(home)
        assert replicas.count(home) >= 0.95 * PER_GROUP, (g, replicas)
        cached = [c for _, c in rows]
        assert all(c > 0 for c in cached[1:]), (g, cached)
        # the prefix's full blocks, at least: 200 tokens are 12 blocks of 16
        assert min(cached[1:]) >= (PREFIX_TOKENS // 16) * 16 - 16, (g, cached)
    assert len(set(homes)) == 2, f"all groups landed on one replica: {homes}"


def _hits(cluster) -> list[float]:
    out = []
    for url in cluster.replica_urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        m = re.search(
            r'^vllm:prefix_cache_hits_total\{[^}]*model_name="smol"[^}]*\} (\S+)$', text, re.M
        )
        assert m, "vllm:prefix_cache_hits_total missing"
        out.append(float(m.group(1)))
    return out


def test_prefix_affinity_text_prompts(cluster, router, direct):
    prompts = []
    for g in range(GROUPS):
        prefix = direct.post("/detokenize", json={"tokens": _prefix_ids(direct, 100 + g)}).json()[
            "prompt"
        ]
        prompts.append([f"{prefix} Question {i} of group {g}: why?" for i in range(PER_GROUP)])
    before = _hits(cluster)
    _check_affinity(_run_groups(cluster, router, prompts))
    after = _hits(cluster)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas hit


def test_prefix_affinity_token_id_prompts(cluster, router, direct):
    prompts = []
    for g in range(GROUPS):
        prefix = _prefix_ids(direct, 200 + g)
        prompts.append([prefix + [30 + i, 1000 + g, 28, 30 + i] for i in range(PER_GROUP)])
    before = _hits(cluster)
    _check_affinity(_run_groups(cluster, router, prompts))
    after = _hits(cluster)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_router_reads_our_load_reports(router, cluster):
    """vllm-router's GET /get_loads polls each worker's /get_load and reads its `load` (-1 when a
    worker's answer lacks it)."""
    loads = {w["worker"]: w["load"] for w in router.get("/get_loads").json()["workers"]}
    assert set(loads) == set(cluster.replica_urls)
    assert all(isinstance(v, int) and v >= 0 for v in loads.values()), loads


# ---- a replica dies mid-run (last: it changes the cluster) ------------------------------------


def test_killing_a_replica_mid_run(cluster, router, direct):
    """Requests with one shared prefix flow through the router; once the first has answered, the
    replica serving them (cache_aware keeps them there) is SIGKILLed mid-run."""
    prefix = _prefix_ids(direct, 300)
    results: list = []
    first = threading.Event()

    def traffic():
        for i in range(16):
            t = time.monotonic()
            try:
                r = router.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": prefix + [40 + i], "max_tokens": 4},
                    timeout=httpx.Timeout(30.0, connect=5.0),
                )
                rid = r.json().get("id") if r.status_code == 200 else r.text[:200]
                results.append((i, r.status_code, time.monotonic() - t, rid))
            except httpx.HTTPError as exc:  # a hang would end here, bounded
                results.append((i, repr(exc), time.monotonic() - t, None))
            first.set()

    worker = threading.Thread(target=traffic, daemon=True)
    t0 = time.monotonic()
    worker.start()
    assert first.wait(60)
    assert results[0][1] == 200, results
    victim = served_by(cluster, results[0][3])
    cluster.kill_replica(victim)
    killed_after = len(results)
    assert cluster.replicas[victim].poll() is not None
    worker.join(timeout=120)
    assert not worker.is_alive(), "requests hung after a replica died"
    assert len(results) == 16
    assert killed_after < 16, "the run ended before the kill"
    # Every request succeeds, the one in flight on the victim when it died included: the router
    # retries it, the victim's circuit breaker opens after two failed attempts (the cluster's
    # router flags), and the retry goes to the survivor.
    assert all(r[1] == 200 for r in results), results
    assert max(r[2] for r in results) < 30, results
    survivors = {served_by(cluster, r[3]) for r in results[killed_after + 1 :]}
    assert survivors == {1 - victim}, (victim, results)
    # The router's health check marked the victim unhealthy (GET /workers).
    victim_url = cluster.replica_urls[victim]
    deadline = time.monotonic() + 15
    while True:
        workers = {w["url"]: w["is_healthy"] for w in router.get("/workers").json()["workers"]}
        if workers.get(victim_url) is False:
            break
        assert time.monotonic() < deadline, f"the router still calls {victim_url} healthy"
        time.sleep(0.5)
    assert workers[cluster.replica_urls[1 - victim]] is True
    # And the survivor serves everything, new prefixes included.
    for k in range(4):
        r = router.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": f"Fresh prompt {k} after the failure", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert served_by(cluster, r.json()["id"]) == 1 - victim
    assert time.monotonic() - t0 < 120


# ---- consistent_hash: the client names the shared prefix ---------------------------------------


def test_consistent_hash_with_a_session_header(tmp_path):
    """`--policy consistent_hash` hashes the X-Session-ID header (docs/scale-out.md): a client that
    sends its shared-prefix key there keeps each group on one replica, token-id prompts included,
    without the router reading the prompt at all."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    args = ["--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "24MiB"]
    with Cluster(2, policy="consistent_hash", replica_args=args, log_dir=tmp_path, env=env) as c:
        with (
            httpx.Client(base_url=c.router_url, timeout=TIMEOUT) as client,
            httpx.Client(base_url=c.replica_urls[0], timeout=TIMEOUT) as replica,
        ):
            for g in range(2):
                prefix = _prefix_ids(replica, 400 + g)
                rows = []
                for i in range(6):
                    r = client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": prefix + [50 + i], "max_tokens": 1},
                        headers={"X-Session-ID": f"prefix-{g}"},
                    )
                    assert r.status_code == 200, r.text
                    j = r.json()
                    rows.append((served_by(c, j["id"]), j["usage"]["prompt_tokens_details"]))
                assert len({where for where, _ in rows}) == 1, rows
                assert all(d["cached_tokens"] > 0 for _, d in rows[1:]), rows
