#!/bin/sh
# Catch up with the bucket, then serve and follow it (python -m deltasync.vllm_ext.serve does all).
# Space variables: MODEL, BUCKET, optional SERVED_MODEL_NAME and VLLM_ARGS (split on spaces),
# DELTASYNC_FOLLOW (default 1: poll the bucket's manifest and sync each new version by itself;
# 0: only a trainer's POST /deltasync/sync changes the version) and DELTASYNC_FOLLOW_INTERVAL_S
# (seconds between polls, default 2). A trainer's pushes are served either way.
# Space secrets: DELTASYNC_API_KEY (bearer token for every route), HF_TOKEN (bucket access).
# Local runs only: DELTASYNC_HOST and DELTASYNC_PORT (a Space serves on 0.0.0.0:7860).
set -eu
: "${MODEL:?set the MODEL variable: the HF model id the trainer trains (config + tokenizer)}"
: "${BUCKET:?set the BUCKET variable: hf://buckets/NAMESPACE/NAME}"
: "${DELTASYNC_API_KEY:?add a DELTASYNC_API_KEY secret: every route requires it}"
: "${DELTASYNC_FOLLOW:=1}"
export DELTASYNC_FOLLOW
# shellcheck disable=SC2086  # VLLM_ARGS is a list of arguments
exec python3 -m deltasync.vllm_ext.serve \
    --model "$MODEL" \
    --bucket "$BUCKET" \
    --host "${DELTASYNC_HOST:-0.0.0.0}" \
    --port "${DELTASYNC_PORT:-7860}" \
    --served-model-name "${SERVED_MODEL_NAME:-$MODEL}" \
    -- ${VLLM_ARGS:-}
