#!/usr/bin/env bash
# Issue 74's GPU runs on a one-GPU host (H100 / H200), one part per call (/tmp stays between calls
# while the machine is held):
#
#   bash bench/gpu/issue74.sh models   the random Wan2.1-T2V-14B written to $MODELS/wan14b and its FP8
#                                      folder (ray-hsdp quantize) to $MODELS/wan14b-fp8, unless there
#   bash bench/gpu/issue74.sh start    the one-GPU fast YAML's group started as a replica builds it, from
#                                      the FP8 folder with a compile cache, in a Ray whose idle workers
#                                      preloaded a rank's modules: first start (cache empty), one warm
#                                      start, two requests at the warmed shape, rank 0 killed to the next
#                                      request answered (bench.start --preload --kill)
#
# No sage wheel on a fresh host: the YAML's attention_backend is replaced by diffusers' default.
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoints.
set -uo pipefail
PART=${1:?models or start}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
STEPS=${STEPS:-4}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
YAML=serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml
mkdir -p "$OUT"

case "$PART" in
  models)
    SECONDS=0
    [ -d "$MODELS/wan14b" ] || python -m ray_hsdp.cli make-random wan2.1-t2v-14b "$MODELS/wan14b" 2>&1 | tail -2
    echo "bf16 folder: ${SECONDS}s"
    [ -d "$MODELS/wan14b-fp8" ] || python -m ray_hsdp.cli quantize "$MODELS/wan14b" "$MODELS/wan14b-fp8" 2>&1 | tail -2
    echo "bf16 and fp8 folders: ${SECONDS}s"
    ;;
  start)
    python -m bench.start --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
      --compile-cache-dir "$MODELS/compile-cache" --repeats 1 --kill --preload --steps "$STEPS" --out "$OUT" \
      --name "start-preload-kill-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/start-preload-1x$GPU.log" 2>&1
    echo "start: exit $?"
    grep "^{'run'" "$OUT/start-preload-1x$GPU.log" | cut -c1-900
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
