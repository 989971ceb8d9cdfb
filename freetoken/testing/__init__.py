"""What tests, benchmarks and the soak share, importable from the installed package (no script
edits sys.path, no test imports a script):

- process.py    ServerProcess: `python -m freetoken` (or a peer) on a free loopback port
- live.py       LiveServer: the app over one Engine in a uvicorn thread, in process
- workloads.py  the benchmarks' deterministic prompts and request bodies
- loadgen.py    the HTTP load generator and its stats
- soak.py       the seeded load / soak mix and its checks
- peers.py, peer_report.py, peer_docs.py  the systems scripts/compare_peers.py runs (and
                their peak RSS), its report, and where in docs/ each model's results go
- gguf_costs.py a GGUF's shapes, bytes per decode step and FLOPs per token (compute_bound.py)

Not part of serving: nothing under freetoken/ outside this package imports it. The load
generator needs the test extra (aiohttp, httpx).
"""
