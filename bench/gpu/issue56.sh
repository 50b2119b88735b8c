#!/usr/bin/env bash
# Issue 56's GPU runs on a one-GPU host (H100 / H200), one part per call: each model at its real size
# with random bf16 weights (real-size text encoders and VAE), one request of 8 steps through plain
# diffusers and through a group of one rank in the same run (bench.model_run); each checkpoint is
# removed after its run (the host's disk holds one at a time).
#
#   bash bench/gpu/issue56.sh videos   Wan2.2-TI2V-5B from a first frame (1280x704, 49 frames) and
#                                      HunyuanVideo-1.5 (848x480, 49 frames)
#   bash bench/gpu/issue56.sh ti2v     the first of those alone
#   bash bench/gpu/issue56.sh qwen     Qwen-Image (1328x1328)
#   bash bench/gpu/issue56.sh qwen-lora  the same with a random LoRA of rank 64 on both sides, timed
#                                      without and with it
#
# The groups decode whole (vae_tiling off), as plain diffusers does: their frames must equal its.
#
# FLUX.2-dev (112 GB of bf16 weights): its checkpoint does not fit such a host's 64 GiB disk, so
# no group runs it; `bash bench/gpu/issue56.sh flux2` builds it in the GPU's memory and runs plain
# diffusers (bench.in_memory); its weights per GPU at S ranks come from bench.weights.
#
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoints.
set -uo pipefail
PART=${1:?videos or qwen}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
mkdir -p "$OUT"

run() {  # run ARCH NAME ARGS...: one bench.model_run, its log beside its results, its checkpoint removed
  local arch=$1 name=$2
  shift 2
  python -m bench.model_run --arch "$arch" --model-dir "$MODELS/$arch" --out "$OUT" \
    --name "model-run-$name-1x$GPU" "$@" >"$OUT/model-run-$name-1x$GPU.log" 2>&1
  echo "$name: exit $?"
  tail -12 "$OUT/model-run-$name-1x$GPU.log"
  rm -rf "${MODELS:?}/$arch" "${MODELS:?}/$arch-loras"
}

case "$PART" in
  videos)
    run wan2.2-ti2v-5b wan2.2-ti2v-5b-i2v --size 1280x704 --frames 49 --steps 8 --guidance 5 --image \
      --pipeline-class WanImageToVideoPipeline
    run hunyuanvideo-1.5 hunyuanvideo-1.5 --size 848x480 --frames 49 --steps 8 --guidance 6
    ;;
  ti2v)  # the first part of videos alone (diffusers' Wan image-to-video needs ftfy on PYTHONPATH)
    run wan2.2-ti2v-5b wan2.2-ti2v-5b-i2v --size 1280x704 --frames 49 --steps 8 --guidance 5 --image \
      --pipeline-class WanImageToVideoPipeline
    ;;
  flux2)
    python -m bench.in_memory --arch flux.2-dev --size 1024x1024 --steps 8 --guidance 4 --out "$OUT" \
      --name "in-memory-flux.2-dev-1x$GPU"
    ;;
  qwen)
    run qwen-image qwen-image --size 1328x1328 --steps 8 --guidance 4
    ;;
  qwen-lora)
    run qwen-image qwen-image-lora64 --size 1328x1328 --steps 8 --guidance 4 --lora-rank 64
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
