#!/usr/bin/env bash
# Issue 64's GPU runs on a one-GPU host (H100 / H200), one part per call (/tmp stays between calls
# while the machine is held):
#
#   bash bench/gpu/issue64.sh sage    SageAttention 2's wheel built for this GPU (ray-hsdp build-kernels,
#                                     from SRC, default .devkernels/SageAttention: the public source tree)
#                                     and installed into $SITE
#   bash bench/gpu/issue64.sh block   one forward of Wan2.1-T2V-14B's transformer at 32,760 tokens per
#                                     setup: plain, FP8 + compile (SDPA), and under sage through diffusers'
#                                     own backend and through the custom op (bench.block_graph --profile);
#                                     EXTRA="--setups ..." NAME=-suffix for other setups (inductor options)
#   bash bench/gpu/issue64.sh more    the same forward compiled with and without CUDA graphs; Qwen-Image's
#                                     forward at 1328x1328 with diffusers' complex RoPE and in real arithmetic;
#                                     the VAE decode of 81 frames at 832x480, eager and compiled (channels-last)
#   bash bench/gpu/issue64.sh loop    a random Wan2.1-T2V-14B written to $MODELS/wan14b, then 81 frames, 8 steps:
#                                     plain diffusers, its compile, and one unsharded rank with the fast options,
#                                     with where each request's time went around the loop (bench.throughput)
#
# OUT (default bench/results) is where logs and results go.
set -uo pipefail
PART=${1:?sage or block}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
SITE=${SITE:-/tmp/site}
SRC=${SRC:-.devkernels/SageAttention}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
mkdir -p "$OUT"
case "$PART" in
  sage)
    python -m ray_hsdp.cli build-kernels sage --source "$SRC" --out /tmp/wheels --jobs 16 \
      >"$OUT/build-kernels-sage-issue64-$GPU.log" 2>&1
    echo "build: exit $?"; tail -3 "$OUT/build-kernels-sage-issue64-$GPU.log"
    python -m pip install -q --no-index --no-deps --target "$SITE" /tmp/wheels/sageattention-*.whl || exit 1
    python -c "import sageattention; print('sageattention', sageattention.__file__)"
    ;;
  block)
    python -m bench.block_graph --profile --out "$OUT" --name "block-graph-wan2.1-14b${NAME:-}-1x$GPU" ${EXTRA:-}
    ;;
  more)
    python -m bench.block_graph --profile --setups sage-op-fp8 sage-op-fp8-cudagraphs --out "$OUT" \
      --name "block-graph-wan2.1-14b-cudagraphs-1x$GPU"
    python -m bench.block_graph --model qwen-image --profile --setups plain sage-op-fp8 sage-op-fp8-realrope \
      --out "$OUT" --name "block-graph-qwen-image-1x$GPU"
    python -m bench.vae --sizes 832x480 --tiling off --variants channels_last_3d channels_last_3d+compile \
      --out "$OUT" --name "vae-decode-wan2.1-480p-compile-1x$GPU"
    ;;
  loop)
    [ -d "$MODELS/wan14b" ] || python -m ray_hsdp.cli make-random wan2.1-t2v-14b "$MODELS/wan14b" 2>&1 | tail -2
    python -m bench.throughput --model-dir "$MODELS/wan14b" --gpus 1 --frames 81 --steps 8 --requests-per-gpu 1 \
      --setups plain plain-compile ceiling-fp8-compile-sage-vaecl --out "$OUT" ${EXTRA:-}
    ;;
esac
