#!/usr/bin/env bash
# Issue 84's GPU runs on a one-GPU host (H100 / H200); /tmp stays between calls while the machine is held.
# Each part writes the random Wan2.1-T2V-14B (real size) and a random LoRA in lightx2v's key layout
# (the original Wan repo's, rank 64) under $MODELS unless there:
#
#   bash bench/gpu/issue84.sh plain   plain diffusers: 81 frames of 832x480 at 40 steps with CFG (the
#                                     folder's scheduler), then the 4-step request with the LoRA fused by
#                                     diffusers (bench.few_step plain)
#   bash bench/gpu/issue84.sh serve   `serve run serve_configs/wan2.1_t2v_14b_4step.yaml` (FP8, compile, the
#                                     LoRA fused at load): three 4-step videos and one of 40 steps with CFG
#                                     and UniPC over /v1/videos/sync, where each one's seconds went, and the
#                                     4-step frames against plain's (bench.few_step serve); LONG_STEPS=10
#                                     for a shorter long request
#
# No sage wheel on a fresh host: the YAML's attention_backend is replaced by diffusers' default.
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoints.
set -uo pipefail
PART=${1:?plain or serve}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
NAME=few-step-wan2.1-t2v-14b-1x$GPU
mkdir -p "$OUT"

source bench/gpu/models.sh  # write_bf16
write_bf16
SECONDS=0
[ -d "$MODELS/lightx2v" ] || python -m ray_hsdp.cli make-random-lora wan2.1-t2v-14b "$MODELS/lightx2v" --layout wan \
  --rank 64 2>&1 | tail -1
echo "lora: ${SECONDS}s"

case "$PART" in
  plain)
    python -m bench.few_step plain --model "$MODELS/wan14b" --lora "$MODELS/lightx2v" --frames-file "$MODELS/plain.npy" --served-file "$MODELS/served.npy" \
      --out "$OUT" --name "$NAME" >"$OUT/$NAME-plain.log" 2>&1
    echo "plain: exit $?"
    tail -14 "$OUT/$NAME-plain.log"
    ;;
  serve)
    python -m bench.few_step serve --model "$MODELS/wan14b" --set loras.lightx2v="$MODELS/lightx2v" \
      --set attention_backend=auto --set compile_cache_dir="$MODELS/compile-cache" --frames-file "$MODELS/plain.npy" --served-file "$MODELS/served.npy" \
      --long-steps "${LONG_STEPS:-40}" \
      --out "$OUT" --name "$NAME" >"$OUT/$NAME.log" 2>&1
    echo "serve: exit $?"
    tail -20 "$OUT/$NAME.log"
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
