#!/usr/bin/env bash
# The next GPU runs of issue 39 (adaptive lanes), on one 4-GPU host (device kind nvidia-h200-x4),
# each one call of at most 10 minutes. The first call carries .devbundle (bash
# ../shared/tools/device_bundle.sh) and runs: bash bench/gpu/slo_issue39.sh n
# Same workload as runs j to m (docs/performance.md): Wan2.1-T2V-14B random bf16, 21 frames, 2 steps,
# 832x480 and 480x320, deadlines 3 x alone on the wide lane, exactly rate x 25 s arrivals per window
# (the seeds follow the position in --rates: 0.9, 1.1 and 1.3 keep runs j-m's arrivals).
#   n: adaptive (lean, with the tick floor) against wide
#   o: adaptive against lanes2
#   p: adaptive-widen (lean with lane_widening)
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/site
for f in .devbundle/*.tar.xz .devextras/*.tar.xz; do [ -f "$f" ] && tar -xJf "$f" -C /tmp/site; done
export PYTHONPATH=/tmp/site:$PWD
run=${1:?which run: n, o or p}
case $run in
  n) layouts="adaptive wide" ;;
  o) layouts="adaptive lanes2" ;;
  p) layouts="adaptive-widen" ;;
  *) echo "unknown run $run" >&2; exit 2 ;;
esac
python -m bench.slo --model-dir /tmp/wan14b --gpus 4 --layouts $layouts --rates 0.9 1.1 1.3 1.5 \
  --sizes 832x480 480x320 --frames 21 --steps 2 --window-s 25 --exact-count --drain-s 15 --targets \
  --alone-s 1.76 1.64 --set request_streams=true 'shard_components=["transformer"]' \
  --out "$OUT" --name "slo-wan2.1-t2v-14b-4xGPU-$run"
