#!/usr/bin/env bash
# N FreeToken replicas on loopback ports behind vllm-router (docs/scale-out.md).
# Usage: scripts/cluster.sh [--replicas N] [--port P] [--policy cache_aware|consistent_hash|...]
#                           [--log-dir DIR] [--router-arg=ARG ...] [-- <python -m freetoken args>]
# Needs: pip install vllm-router==0.1.17. Ctrl-C / SIGTERM stops the router and every replica.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m freetoken.cluster "$@"
