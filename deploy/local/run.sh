#!/usr/bin/env bash
# Local stack on one machine: vLLM + attnprof (`attnprof serve`) and a Prometheus scraping it
# with attnprof's alert rules. Ctrl-C stops both. Needs `make setup` (or `make demo`) first.
# Usage: deploy/local/run.sh [--model PATH|smollm2] [-- extra vLLM args]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
command -v prometheus >/dev/null || { echo "prometheus not installed (apt-get install prometheus)" >&2; exit 1; }
data="$(mktemp -d)"
prometheus --config.file="$here/prometheus.yml" --storage.tsdb.path="$data" \
  --web.listen-address=127.0.0.1:9090 >"$data/prometheus.log" 2>&1 &
prom=$!
trap 'kill $prom 2>/dev/null; rm -rf "$data"' EXIT
echo "Prometheus: http://127.0.0.1:9090 (alerts: /alerts); import grafana/dashboards/attnprof.json into Grafana" >&2
"$repo/.venv/bin/attnprof" serve --port 8000 "$@"
