"""The engine: requests in, token deltas out, one thread stepping the model over a paged KV pool.

One job per module: engine (the loop and its asyncio edge), scheduler (who computes what this
step), kv_cache (block pool and prefix index), runner (a step's tensors through the model),
sampler (logits -> tokens and logprobs), sequence (one request's state), outputs (what a request
gets back), sampling_params (a request's validated sampling fields), batch (the plain data the
runner hands the model), generate (the bare model, greedy, for checks; not used by the engine).
"""

from freetoken.engine.engine import Engine, EngineLimits
from freetoken.engine.outputs import RequestOutput, RequestStream, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineLimits", "RequestOutput", "RequestStream", "SamplingParams",
           "TokenLogprob"]
