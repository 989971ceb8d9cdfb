"""The workloads that benchmarks and tests share: deterministic prompts (a shared few-shot
classify prefix, 16 classifier prefixes, 16 decode prompts), fixed seeds, no downloads, and the
request bodies built from them.

  classify        a shared ~170-token few-shot sentiment prefix + a unique ~25-token review +
                  "Sentiment:"; max_tokens 1, temperature 0, logprobs 2; 200 requests, 8 in flight
  classify-multi  the same, but 16 distinct instruction prefixes (many classifiers behind one
                  server); each request picks one at random (seeded)
  decode          16 distinct short prompts, 8 in flight, 128 greedy tokens each, ignore_eos
  decode-1        the decode prompts one at a time (single stream), 4 requests by default

What it is not: the client that sends them (loadgen.py) or a benchmark's command line
(scripts/bench_serve.py, scripts/bench_engine.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_PRODUCTS = ["vacuum", "laptop stand", "rain coat", "desk lamp", "kettle", "phone case",
             "backpack", "air fryer", "keyboard", "water bottle", "monitor", "tent"]
_GOOD = ["works perfectly", "exceeded my expectations", "feels premium", "was easy to set up",
         "is worth every penny", "arrived early and well packed"]
_BAD = ["stopped working", "feels cheap and flimsy", "smells like burnt plastic",
        "was missing parts", "is far too loud", "broke on the first use"]
_TAIL = ["I would recommend it to friends.", "I am returning it tomorrow.",
         "My partner noticed the difference immediately.", "Customer service was polite.",
         "The instructions were confusing though.", "Not sure I would buy it again."]

# classify-multi: 16 classifiers = 16 instruction headers x seeded few-shot example choices.
_HEADERS = [
    "You are a careful assistant. Classify the sentiment of each product review as Positive or "
    "Negative. Answer with one word.",
    "Read the customer review and decide whether the customer was happy (Positive) or unhappy "
    "(Negative). Reply with a single word.",
    "Task: sentiment analysis for an online shop. Label every review Positive or Negative.",
    "You label support tickets and reviews. Output Positive when the writer is satisfied and "
    "Negative otherwise.",
    "Decide the polarity of the following marketplace reviews. Use only Positive or Negative.",
    "As a quality analyst, tag each review with its sentiment: Positive or Negative.",
    "Classify the opinion expressed in each review. The only allowed answers are Positive and "
    "Negative.",
    "Below are product reviews with their sentiment. Continue the pattern for the last review.",
]
_EXAMPLES = [
    ("The blender broke after two days and the seller never answered my emails.", "Negative"),
    ("Absolutely love this jacket, it is warm, light and the zipper feels solid.", "Positive"),
    ("The headphones sound muddy and the left ear stopped working within a week.", "Negative"),
    ("Great value for the price; my kids use this tablet every day without issues.", "Positive"),
    ("Shipping took a month and the box arrived crushed with pieces missing inside.", "Negative"),
    ("This coffee maker is quiet, fast and the coffee tastes better than the cafe.", "Positive"),
    ("The mattress sags in the middle already and the return process is a nightmare.",
     "Negative"),
    ("My new running shoes are comfortable from the first mile and look fantastic.", "Positive"),
    ("The printer jams on every second page and the ink runs out absurdly fast.", "Negative"),
    ("Setup took five minutes and the speaker fills the whole living room with sound.",
     "Positive"),
    ("The charger overheats and the cable frayed after a couple of weeks of use.", "Negative"),
    ("Beautiful frying pan, nothing sticks and it cleans up in seconds.", "Positive"),
]


def few_shot(k: int, header: int = 0) -> str:
    """An instruction header and the first k labelled examples, each "Review: ...\nSentiment:
    ...", ready for the review to classify."""
    body = "".join(f"Review: {r}\nSentiment: {s}\n\n" for r, s in _EXAMPLES[:k])
    return f"{_HEADERS[header]}\n\n{body}"


# The classify prefix (~170 tokens) every classify request shares.
PREFIX = few_shot(6)

DECODE_PROMPTS = [
    "Write a story about a dragon.", "Explain how a bicycle works.", "List facts about Mars.",
    "Describe your ideal breakfast.", "What is the history of Rome?", "How do magnets work?",
    "Tell me about the ocean.", "Give advice to a new programmer.", "Why is the sky blue?",
    "Describe a walk in the forest.", "How does a compiler work?", "Write a letter to a friend.",
    "What makes a good teacher?", "Explain photosynthesis simply.", "Plan a trip to Japan.",
    "Describe the life of a bee.",
]

WORKLOADS = {
    # name: (default requests, default in flight, max_tokens, stream by default)
    "classify": (200, 8, 1, False),
    "classify-multi": (200, 8, 1, False),
    "decode": (16, 8, 128, True),
    "decode-4": (8, 4, 128, True),
    "decode-1": (4, 1, 128, True),
}


def reviews(n: int, seed: int = 0) -> list[str]:
    """The unique review tails: n deterministic ~25-token reviews, alternating bad/good."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        verdict = rng.choice(_GOOD if i % 2 else _BAD)
        out.append(f"The {rng.choice(_PRODUCTS)} I bought in week {i} {verdict} after "
                   f"{rng.randint(2, 30)} days. {rng.choice(_TAIL)}")
    return out


def multi_prefixes(k: int = 16, seed: int = 1) -> list[str]:
    """k distinct few-shot prefixes of about the classify prefix's length (6 examples each)."""
    rng = random.Random(seed)
    out = []
    for j in range(k):
        header = _HEADERS[j % len(_HEADERS)]
        shots = rng.sample(_EXAMPLES, 6)
        body = "".join(f"Review: {r}\nSentiment: {s}\n\n" for r, s in shots)
        out.append(f"{header}\n\n{body}")
    assert len(set(out)) == k
    return out


@dataclass
class Req:
    prompt: str
    max_tokens: int
    classify: bool
    tag: str = ""  # e.g. which prefix a classify-multi request uses


def build_workload(name: str, n: int | None = None, seed: int = 0,
                   max_tokens: int | None = None) -> list[Req]:
    """The requests of a workload, in submission order (deterministic for a given seed)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}")
    n_def, _, mt_def, _ = WORKLOADS[name]
    n = n_def if n is None else n
    mt = mt_def if max_tokens is None else max_tokens
    if name == "classify":
        return [Req(PREFIX + f"Review: {r}\nSentiment:", mt, True, "p0")
                for r in reviews(n, seed)]
    if name == "classify-multi":
        pre = multi_prefixes()
        rng = random.Random(seed + 12345)
        out = []
        for r in reviews(n, seed):
            j = rng.randrange(len(pre))
            out.append(Req(pre[j] + f"Review: {r}\nSentiment:", mt, True, f"p{j}"))
        return out
    # decode / decode-4 / decode-1: cycle through the 16 prompts
    return [Req(DECODE_PROMPTS[i % len(DECODE_PROMPTS)], mt, False, f"d{i % 16}")
            for i in range(n)]


def warmup_requests(name: str, k: int) -> list[Req]:
    """k requests of the workload's shape that are not among the measured ones."""
    if k <= 0:
        return []
    if name.startswith("classify"):
        reqs = build_workload(name, k, seed=999)
        return [Req(r.prompt.replace(" in week ", " in month "), r.max_tokens, True, r.tag)
                for r in reqs]
    return [Req("Say something nice about autumn.", 8, False, "w")] * k


def payload(req: Req, flavor: str, model: str | None, stream: bool) -> dict:
    """The request body. FreeToken refuses unknown fields (400), so only OpenAI fields plus
    vLLM's `ignore_eos` go to it; llama-server takes its own extras (`cache_prompt`)."""
    body: dict = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0}
    if model:
        body["model"] = model
    if req.classify:
        body["logprobs"] = 2
    else:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if flavor == "llama-server":
        # llama-server maps max_tokens -> n_predict, `logprobs` -> n_probs and reads ignore_eos
        # from the body; temperature 0 is greedy there too. Keep its prompt cache on explicitly
        # (the default).
        body["cache_prompt"] = True
    return body
