#!/bin/sh
# A ratchet worker on a cluster: join the Ray cluster as a node of its own, then run
# `ratchet worker` (a Temporal worker and a Ray driver: a driver needs a raylet on its own
# machine). The node offers RATCHET_NODE_CPUS CPUs (default 0: no actors land here, they
# go to the Ray worker nodes) and RATCHET_NODE_GPUS GPUs (default 0).
#
# Needs RATCHET_RAY_ADDRESS (the head's GCS, host:port) and, as every Ray process of the
# cluster, RAY_AUTH_MODE=token with RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH). SIGTERM stops
# the worker first (its running activities are handed back), then the node.
set -eu

: "${RATCHET_RAY_ADDRESS:?set RATCHET_RAY_ADDRESS to the Ray head, e.g. ray-head:6379}"
if [ "${RAY_AUTH_MODE:-}" != "token" ] || { [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; }; then
    echo "ratchet-node: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) as on every Ray process of the cluster" >&2
    exit 2
fi

ray start --address="${RATCHET_RAY_ADDRESS}" \
    --num-cpus="${RATCHET_NODE_CPUS:-0}" --num-gpus="${RATCHET_NODE_GPUS:-0}" \
    --disable-usage-stats

ratchet worker &
worker=$!
trap 'kill -TERM "$worker" 2>/dev/null || true' TERM INT
# The first wait returns when a signal arrives; the second waits for the worker to finish.
status=0
wait "$worker" || status=$?
if kill -0 "$worker" 2>/dev/null; then
    wait "$worker" || status=$?
fi
ray stop >/dev/null 2>&1 || true
exit "$status"
