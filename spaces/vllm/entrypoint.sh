#!/bin/sh
# Catch up with the bucket, then serve (python -m deltasync.vllm_ext.serve does both).
# Space variables: MODEL, BUCKET, optional SERVED_MODEL_NAME and VLLM_ARGS (split on spaces).
# Space secrets: DELTASYNC_API_KEY (bearer token for every route), HF_TOKEN (bucket access).
set -eu
: "${MODEL:?set the MODEL variable: the HF model id the trainer trains (config + tokenizer)}"
: "${BUCKET:?set the BUCKET variable: hf://buckets/NAMESPACE/NAME}"
: "${DELTASYNC_API_KEY:?add a DELTASYNC_API_KEY secret: every route requires it}"
# shellcheck disable=SC2086  # VLLM_ARGS is a list of arguments
exec python3 -m deltasync.vllm_ext.serve \
    --model "$MODEL" \
    --bucket "$BUCKET" \
    --host 0.0.0.0 \
    --port 7860 \
    --served-model-name "${SERVED_MODEL_NAME:-$MODEL}" \
    -- ${VLLM_ARGS:-}
