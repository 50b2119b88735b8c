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
#
# OUT (default bench/results) is where logs and results go.
set -uo pipefail
PART=${1:?sage or block}
OUT=${OUT:-bench/results}
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
esac
