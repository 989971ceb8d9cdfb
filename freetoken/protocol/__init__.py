"""The wire protocol: what a request may say, and what an answer looks like.

    requests.py   the pydantic request models (strict; NeutralOnly fields)
    limits.py     the checks against the model and the caps, shared with the engine
    prompts.py    prompt forms and chat messages -> token ids
    parse.py      parse_completion / parse_chat / parse_tokenize / parse_detokenize
    responses.py  engine deltas -> OpenAI response bodies and SSE chunks

Pure functions and plain data: no I/O, no engine, no HTTP (the server renders the errors these
raise). NOTE: this file imports nothing: the engine imports protocol.limits, and parse.py imports
the engine's SamplingParams, so a package that imported its modules here would be a cycle.
"""
