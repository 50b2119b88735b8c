#!/usr/bin/env bash
# Issue 62's GPU runs on a one-GPU host (H100 / H200), one part per call (/tmp stays between calls
# while the machine is held):
#
#   bash bench/gpu/issue62.sh fp8     the random Wan2.1-T2V-14B written to $MODELS/wan14b, its FP8 folder
#                                     (ray-hsdp quantize) to $MODELS/wan14b-fp8, both loaded by a rank of
#                                     its own and one forward of each compared (bench.fp8_folder)
#   bash bench/gpu/issue62.sh probe   where a rank's actor start and imports go (bench.actor_start), after
#                                     writing $MODELS/wan14b and its FP8 folder if they are not there
#   bash bench/gpu/issue62.sh start   the one-GPU fast YAML's group started as a replica builds it, from
#                                     the FP8 folder with a compile cache: first start (cache empty), one
#                                     warm start, two requests at the warmed shape, a rank killed
#                                     (bench.start --config ... --kill)
#   bash bench/gpu/issue62.sh models  $MODELS/wan14b and its FP8 folder written, unless there (issue 74)
#   bash bench/gpu/issue62.sh start-preload   the start part's runs in a Ray whose idle workers preloaded
#                                     a rank's modules (bench.start --preload; issue 74); beside start's
#                                     runs on the same machine, the plain baseline
#   bash bench/gpu/issue62.sh cold    a node that never ran the model: in a Ray whose idle workers preloaded a
#                                     rank's modules, the first start (it fills the compile cache), then one
#                                     after dropping the page cache (bench.start --preload --cold; issue 74)
#   bash bench/gpu/issue62.sh warm-up the start part's runs (no kill) twice: the YAML's warm-up, then its shape
#                                     warmed with decode: false (the steps alone), with the warm-up's own
#                                     record (issue 74)
#   bash bench/gpu/issue62.sh video   the same YAML through `serve run` and the openai client: two
#                                     81-frame jobs at the warmed shape, then plain diffusers
#                                     (bench.video_http --plain; from the bf16 folder, which plain
#                                     diffusers reads)
#   bash bench/gpu/issue62.sh image   Qwen-Image (random, real size; $MODELS/wan14b* removed first: the disk
#                                     holds one of them) on one GPU through `serve run`: png and jpeg
#                                     responses against the group's own run (bench.image_http)
#
# No sage wheel on a fresh host: the YAML's attention_backend is replaced by diffusers' default.
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoints.
set -uo pipefail
PART=${1:?fp8, models, probe, start, start-preload, cold, warm-up, video or image}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
STEPS=${STEPS:-4}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
YAML=serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml
mkdir -p "$OUT"

source bench/gpu/models.sh  # write_models

case "$PART" in
  fp8)
    python -m bench.fp8_folder --model-dir "$MODELS/wan14b" --fp8-dir "$MODELS/wan14b-fp8" --out "$OUT" \
      --name "fp8-folder-wan2.1-t2v-14b-1x$GPU" 2>&1 | tail -20
    ;;
  models)
    write_models
    ;;
  probe)
    write_models
    python -m bench.actor_start --model-dir "$MODELS/wan14b-fp8" --repeats 2 --out "$OUT" \
      --name "actor-start-1x$GPU" 2>&1 | grep "^|"
    ;;
  start)
    python -m bench.start --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
      --compile-cache-dir "$MODELS/compile-cache" --repeats 1 --kill --steps "$STEPS" --out "$OUT" \
      --name "start-yaml-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/start-yaml-1x$GPU.log" 2>&1
    echo "start: exit $?"
    grep "^{'run'" "$OUT/start-yaml-1x$GPU.log" | cut -c1-600
    ;;
  start-preload)
    python -m bench.start --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
      --compile-cache-dir "$MODELS/compile-cache" --repeats 1 --kill --preload --steps "$STEPS" --out "$OUT" \
      --name "start-preload-kill-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/start-preload-1x$GPU.log" 2>&1
    echo "start-preload: exit $?"
    grep "^{'run'" "$OUT/start-preload-1x$GPU.log" | cut -c1-900
    ;;
  cold)
    write_models
    python -m bench.start --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
      --compile-cache-dir "$MODELS/compile-cache" --repeats 0 --cold --preload --steps "$STEPS" --out "$OUT" \
      --name "start-preload-cold-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/start-preload-cold-1x$GPU.log" 2>&1
    echo "cold: exit $?"
    grep "^{'run'" "$OUT/start-preload-cold-1x$GPU.log" | cut -c1-1500
    ;;
  warm-up)
    for variant in whole steps-only; do
      SET=()
      [ "$variant" = steps-only ] && SET=(--set 'warm_up=[{"size": "832x480", "num_frames": 81, "decode": false}]')
      python -m bench.start --config "$YAML" --model-dir "$MODELS/wan14b-fp8" --set attention_backend=auto \
        "${SET[@]}" --compile-cache-dir "$MODELS/compile-cache" --repeats 1 --steps "$STEPS" --out "$OUT" \
        --name "start-warm-up-$variant-wan2.1-t2v-14b-fp8-folder-1x$GPU" >"$OUT/start-warm-up-$variant-1x$GPU.log" 2>&1
      echo "warm-up $variant: exit $?"
      grep "^{'run'" "$OUT/start-warm-up-$variant-1x$GPU.log" | cut -c1-1500
    done
    ;;
  video)
    python -m bench.video_http --config "$YAML" --model "$MODELS/wan14b" --set attention_backend=auto \
      --set compile_cache_dir="$MODELS/compile-cache" --size 832x480 --seconds 5 --steps "$STEPS" --jobs 2 \
      --out "$OUT" --name "video-http-wan2.1-t2v-14b-fast-warmup-1x$GPU" --plain 2>&1 | tail -5
    cat "$OUT/video-http-wan2.1-t2v-14b-fast-warmup-1x$GPU.md"
    ;;
  image)
    rm -rf "$MODELS/wan14b" "$MODELS/wan14b-fp8"
    [ -d "$MODELS/qwen-image" ] || python -m ray_hsdp.cli make-random qwen-image "$MODELS/qwen-image" 2>&1 | tail -2
    python -m bench.image_http --config serve_configs/qwen_image.yaml --model "$MODELS/qwen-image" \
      --set shard_size=1 --set replicate_size=1 --size 1328x1328 --steps "$STEPS" --formats png jpeg --repeats 3 \
      --out "$OUT" --name "image-http-qwen-image-1x$GPU" 2>&1 | tail -12
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
