#!/usr/bin/env bash
# The runs of a 2-, 4- or 8-GPU host (issue 6), one part per call so that each fits a 10-minute slot:
#
#   bash bench/multi_gpu.sh GPUS PART        PART: wan21 | a14b-memory | a14b-throughput
#
#   wan21            Wan2.1-14B, 21 and 81 frames: plain diffusers on every GPU (the baseline),
#                    R=GPUS x S=1 (ceiling) vs batch on 1xGPUS, 2x(GPUS/2) from 4 GPUs, 4x2 on 8
#   a14b-memory      Wan2.2 A14B (both experts): weights per GPU at S=1 and S=min(GPUS, 4)
#   a14b-throughput  Wan2.2 A14B, 21 frames: batch with S=4 (R=GPUS/4) vs the ceiling
#
# DEVICE=cpu runs the same parts with tiny architectures on gloo ranks (a dry run on a CPU host);
# OUT (default bench/results) and MODELS (default /tmp) say where results and checkpoints go;
# PYTHON (default python) is the interpreter with ray_hsdp installed.
set -euo pipefail
GPUS=${1:?number of GPUs}
PART=${2:?wan21, a14b-memory or a14b-throughput}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
PYTHON=${PYTHON:-python}
if [ "$DEVICE" = cpu ]; then
  # Tiny checkpoints, small frames, and a logical CPU per rank beside the real ones.
  COMMON=(--device cpu --width 64 --height 64)
  # A Ray of its own with a logical CPU per rank, unless RAY_ADDRESS names a cluster to join.
  if [ -z "${RAY_ADDRESS:-}" ]; then COMMON+=(--ray-cpus $((GPUS * 2))); fi
  FRAMES=(5)  # one frame count: the dry run checks that every setup runs, not how cost grows
  SETUPS=(plain batch)  # the ceiling is batch's own code with groups of one rank
  SUFFIX=-tiny
else
  COMMON=(--device cuda)
  FRAMES=(21 81)
  SETUPS=(plain ceiling batch)
  SUFFIX=
fi
LAYOUTS=("1x$GPUS")
if [ "$GPUS" -ge 4 ]; then LAYOUTS+=("2x$((GPUS / 2))"); fi  # on 2 GPUs, 2x1 is the ceiling
if [ "$GPUS" -ge 8 ]; then LAYOUTS+=("4x$((GPUS / 4))"); fi
SHARDS=$((GPUS < 4 ? GPUS : 4))

case "$PART" in
  wan21)
    "$PYTHON" -m bench.throughput --arch wan2.1-t2v-14b --model-dir "$MODELS/wan14b$SUFFIX" --gpus "$GPUS" \
      --frames "${FRAMES[@]}" --steps 2 --setups "${SETUPS[@]}" --layouts "${LAYOUTS[@]}" "${COMMON[@]}" \
      --out "$OUT"
    ;;
  a14b-memory)
    "$PYTHON" -m bench.memory --arch wan2.2-t2v-a14b --model-dir "$MODELS/wan22$SUFFIX" --shard-sizes 1 "$SHARDS" \
      --frames "${FRAMES[0]}" "${COMMON[@]}" --out "$OUT"
    ;;
  a14b-throughput)
    "$PYTHON" -m bench.throughput --arch wan2.2-t2v-a14b --model-dir "$MODELS/wan22$SUFFIX" --gpus "$GPUS" \
      --frames "${FRAMES[0]}" --steps 2 --setups ceiling batch --layouts "$((GPUS / 4))x4" "${COMMON[@]}" --out "$OUT"
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
