#!/usr/bin/env bash
# Issue 83's GPU runs on a one-GPU host (H100 / H200); /tmp stays between calls while the machine is held:
#
#   bash bench/gpu/issue83.sh sleep   the random Wan2.1-T2V-14B and its FP8 folder written to $MODELS unless
#                                     there, then the one-GPU fast YAML's group: two warm requests, then three
#                                     sleep / wake / request cycles beside the link's own copy of the same
#                                     bytes (bench.sleep_wake)
#   bash bench/gpu/issue83.sh sleep-quick   the same from the bf16 folder alone (FP8 quantized at the load), two cycles
#   bash bench/gpu/issue83.sh sleep-min     the least device time: no compile, no warm-up, 1-step requests
#   bash bench/gpu/issue83.sh sleep-levels  level 1 (pinned host memory) and level 2 (a file on disk, its
#                                     page cache kept, then dropped) from the FP8 folder, eager, 832x480 images
#                                     (the bf16 transformer is removed first: the disk holds the FP8 folder and
#                                     the level-2 file, not both folders and the file)
#   bash bench/gpu/issue83.sh share-and-levels  two models of the FP8 folder on one share (one awake), then
#                                     sleep-levels: the least machine starts for both
#   bash bench/gpu/issue83.sh share   two models on one GPU share, one awake at a time, through `ray-hsdp serve
#                                     --config` (its phase table): the FP8 folder and the bf16 folder of that
#                                     Wan2.1-T2V-14B as two models; each twice (warm), then alternating
#                                     (bench.gpu_share)
#   bash bench/gpu/issue83.sh serve   `ray-hsdp serve` of the one-GPU fast YAML on the FP8 folder, its compile
#                                     cache filled by the sleep part: the phase table from the command to
#                                     /health 200, then Ctrl-C
#
# No sage wheel on a fresh host: the YAML's attention_backend is replaced by diffusers' default.
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoints.
set -uo pipefail
PART=${1:?sleep, share or serve}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
STEPS=${STEPS:-4}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
YAML=serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml
mkdir -p "$OUT"

source bench/gpu/models.sh  # write_models, write_bf16

# A sleep_wake run from the bf16 folder alone, its linears quantized at the load: its tag, its result's
# name, and its own flags.
sleep_from_bf16() {
  local tag=$1 name=$2
  shift 2
  write_bf16
  python -m bench.sleep_wake --config "$YAML" --model-dir "$MODELS/wan14b" --set attention_backend=auto "$@" \
    --cycles 2 --out "$OUT" --name "$name-1x$GPU" >"$OUT/sleep-wake-$tag-1x$GPU.log" 2>&1
  echo "sleep-$tag: exit $?"
  tail -12 "$OUT/sleep-wake-$tag-1x$GPU.log"
}

case "$PART" in
  sleep)
    write_models
    python -m bench.sleep_wake --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
      --compile-cache-dir "$MODELS/compile-cache" --steps "$STEPS" --cycles 3 --out "$OUT" \
      --name "sleep-wake-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/sleep-wake-1x$GPU.log" 2>&1
    echo "sleep: exit $?"
    tail -12 "$OUT/sleep-wake-1x$GPU.log"
    ;;
  sleep-quick)
    # The same from the bf16 folder alone (no FP8 folder to write).
    sleep_from_bf16 quick sleep-wake-wan2.1-t2v-14b-fp8-at-load --compile-cache-dir "$MODELS/compile-cache" \
      --steps "$STEPS"
    ;;
  sleep-min)
    # The least device time: the bf16 folder alone, no compile, no warm-up.
    sleep_from_bf16 min sleep-wake-wan2.1-t2v-14b-fp8-at-load-eager --set compile=false --set 'warm_up=[]'
    ;;
  share-and-levels)
    # One machine's start for both: two models of the FP8 folder on one share, then the levels.
    write_models
    rm -rf "$MODELS/wan14b/transformer"
    timeout -s INT 240 python -m bench.gpu_share --model wan-a="$MODELS/wan14b-fp8" --set wan-a.quantization=fp8 \
      --model wan-b="$MODELS/wan14b-fp8" --set wan-b.quantization=fp8 --size 832x480 --steps "$STEPS" \
      --alternations 3 --out "$OUT" --name "gpu-share-wan2.1-t2v-14b-fp8-twice-1x$GPU" \
      >"$OUT/gpu-share-twice-1x$GPU.log" 2>&1
    echo "share: exit $?"
    tail -12 "$OUT/gpu-share-twice-1x$GPU.log"
    python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1
    bash "$0" sleep-levels
    ;;
  sleep-levels)
    write_models
    rm -rf "$MODELS/wan14b/transformer"
    for level in 1 2; do
      timeout 170 python -m bench.sleep_wake --config "$YAML" --model-dir "$MODELS/wan14b-fp8" \
        --set attention_backend=auto --set compile=false --set 'warm_up=[{"size": "832x480", "num_frames": 1}]' --set sleep_level=$level \
        --set sleep_dir="$MODELS/spill" --steps "$STEPS" --cycles 4 --cold-cycles $((level == 2 ? 2 : 0)) \
        --out "$OUT" --name "sleep-wake-level$level-wan2.1-t2v-14b-fp8-folder-eager-1x$GPU" \
        >"$OUT/sleep-level$level-1x$GPU.log" 2>&1
      echo "level $level: exit $?"
      tail -9 "$OUT/sleep-level$level-1x$GPU.log"
    done
    ;;
  share)
    write_models
    python -m bench.gpu_share --model wan-fp8="$MODELS/wan14b-fp8" --set wan-fp8.quantization=fp8 \
      --model wan-bf16="$MODELS/wan14b" --size 832x480 --steps "$STEPS" --alternations 3 --out "$OUT" \
      --name "gpu-share-wan2.1-t2v-14b-fp8-and-bf16-1x$GPU" >"$OUT/gpu-share-1x$GPU.log" 2>&1
    echo "share: exit $?"
    tail -30 "$OUT/gpu-share-1x$GPU.log"
    ;;
  serve)
    python -m ray_hsdp.cli serve "$MODELS/wan14b-fp8" --config "$YAML" --set attention_backend=auto \
      --set compile_cache_dir="$MODELS/compile-cache" >"$OUT/serve-phases-1x$GPU.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 400); do grep -q "^Serving " "$OUT/serve-phases-1x$GPU.log" && break; sleep 0.5; done
    kill -INT $pid; wait $pid
    sed -n '/^Ready in/,/^Serving /p' "$OUT/serve-phases-1x$GPU.log"
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
