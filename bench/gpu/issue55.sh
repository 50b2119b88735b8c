#!/usr/bin/env bash
# Issue 55's GPU runs on a one-GPU Hopper host (H100 / H200), one part per call:
#
#   bash bench/gpu/issue55.sh kernels   SRC WHEELS   both kernel wheels built by `ray-hsdp build-kernels`
#                                                    from the sources under SRC (SageAttention/,
#                                                    flash-attention/ with csrc/cutlass), the random
#                                                    Wan2.1-T2V-14B written to $MODELS/wan14b meanwhile
#   bash bench/gpu/issue55.sh video     WHEELS       the wheels installed, then the one-GPU fast YAML
#                                                    through `serve run` and the openai client, one
#                                                    81-frame 832x480 8-step video, and the same
#                                                    request through plain diffusers (bench.video_http)
#
# OUT (default bench/results) is where logs and results go; MODELS (default /tmp) the checkpoint;
# SITE (default /tmp/site) the folder on PYTHONPATH where the wheels are installed.
set -uo pipefail
PART=${1:?kernels or video}
OUT=${OUT:-bench/results}
MODELS=${MODELS:-/tmp}
SITE=${SITE:-/tmp/site}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed -e "s/NVIDIA //" -e "s/ .*//")
mkdir -p "$OUT"

wait_for() {  # wait_for FILE SECONDS: until FILE exists
  local deadline=$((SECONDS + $2))
  until [ -e "$1" ] || [ $SECONDS -gt $deadline ]; do sleep 5; done
  [ -e "$1" ]
}

case "$PART" in
  kernels)
    SRC=${2:?source folder} WHEELS=${3:?wheel folder}
    mkdir -p "$WHEELS"
    if [ ! -e "$MODELS/wan14b/model_index.json" ]; then
      setsid nohup bash -c "python -m ray_hsdp.cli make-random wan2.1-t2v-14b $MODELS/wan14b && touch $MODELS/wan14b.done" \
        >"$MODELS/make-random.log" 2>&1 &
    fi
    # SageAttention's build is the long one: it runs on past this call if it must (setsid).
    setsid nohup bash -c "python -m ray_hsdp.cli build-kernels sage --source $SRC/SageAttention \
      --out $WHEELS --jobs 16 && touch $WHEELS/sage.done" >"$WHEELS/sage.log" 2>&1 &
    python -m ray_hsdp.cli build-kernels fa3 --source "$SRC/flash-attention" --out "$WHEELS" \
      --jobs 16 >"$OUT/build-kernels-fa3-$GPU.log" 2>&1
    echo "fa3: exit $?"
    wait_for "$WHEELS/sage.done" 300 && echo "sage: built" || echo "sage: still building"
    cp "$WHEELS/sage.log" "$OUT/build-kernels-sage-$GPU.log"
    tail -3 "$MODELS/make-random.log"
    ls -la "$WHEELS"
    ;;
  video)
    WHEELS=${2:?wheel folder}
    wait_for "$WHEELS/sage.done" 400 || { echo "no sage wheel"; tail -20 "$WHEELS/sage.log"; exit 1; }
    cp "$WHEELS/sage.log" "$OUT/build-kernels-sage-$GPU.log"
    wait_for "$MODELS/wan14b.done" 300 || { echo "no checkpoint"; tail -5 "$MODELS/make-random.log"; exit 1; }
    python -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl || exit 1
    python -c "import sageattention, flash_attn_interface; print('kernels import')" || exit 1
    python -m bench.video_http --config serve_configs/wan2.1_t2v_14b_fast_1gpu.yaml --model "$MODELS/wan14b" \
      --size 832x480 --seconds 5 --steps 8 --jobs 2 --out "$OUT" --name "video-http-wan2.1-t2v-14b-fast${NAME:-}-1x$GPU" ${EXTRA:---plain}
    ;;
  *)
    echo "unknown part $PART" >&2
    exit 2
    ;;
esac
