#!/usr/bin/env bash
# Print the manifests in this folder with the two pins filled in, for
#   VLLM_IMAGE_DIGEST=... ATTNPROF_WHEEL_SHA256=... deploy/k8s/render.sh | kubectl apply -f -
# VLLM_IMAGE_DIGEST:     digest of vllm/vllm-openai:v0.32.0 (with or without "sha256:"), e.g.
#                        crane digest vllm/vllm-openai:v0.32.0
# ATTNPROF_WHEEL_SHA256: sha256 of the attnprof wheel your index serves, e.g.
#                        pip hash dist/attnprof-0.1.0-py3-none-any.whl
# Refuses anything that is not 64 hex digits, so an unfilled pin never reaches the cluster.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pin() {  # NAME VALUE -> the 64 hex digits, or exit
  local v="${2#sha256:}"
  v="${v,,}"
  [[ "$v" =~ ^[0-9a-f]{64}$ ]] || { echo "render.sh: $1 must be a sha256 (64 hex digits), got '$2'" >&2; exit 1; }
  printf '%s' "$v"
}
vllm="$(pin VLLM_IMAGE_DIGEST "${VLLM_IMAGE_DIGEST:?set VLLM_IMAGE_DIGEST (see deploy/README.md)}")"
wheel="$(pin ATTNPROF_WHEEL_SHA256 "${ATTNPROF_WHEEL_SHA256:?set ATTNPROF_WHEEL_SHA256 (see deploy/README.md)}")"
for f in "$here"/*.yaml; do
  echo "---"
  sed -e "s/\${VLLM_IMAGE_DIGEST}/$vllm/g" -e "s/\${ATTNPROF_WHEEL_SHA256}/$wheel/g" "$f"
done
