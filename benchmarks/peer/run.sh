#!/usr/bin/env bash
# One run of the peer on the default job (see README.md here): its server, then its 10
# clients, in the peer's own environment. Usage: benchmarks/peer/run.sh PEER_VENV JOB.pt
# The server's log is left in the current folder (peer-server.log); its last line is JSON.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$1/bin/activate"
export PEER_JOB="$(realpath "$2")" FLWR_TELEMETRY_ENABLED=0
python "$here/peer_server.py" > peer-server.log 2>&1 &
server=$!
sleep 4  # the server's port open before the clients connect
python "$here/peer_clients.py" > peer-clients.log 2>&1 &
clients=$!
wait "$server"
kill "$clients" 2>/dev/null || true
wait "$clients" 2>/dev/null || true
grep -E "^round 20 |peer_seconds_per_round" peer-server.log
