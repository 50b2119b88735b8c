# Sourced by bench/gpu/issue*.sh: the random Wan2.1-T2V-14B (real size) under $MODELS, written unless there.

write_bf16() {
  SECONDS=0
  [ -d "$MODELS/wan14b" ] || python -m ray_hsdp.cli make-random wan2.1-t2v-14b "$MODELS/wan14b" 2>&1 | tail -2
  echo "bf16 folder: ${SECONDS}s"
}

write_models() {  # and its FP8 folder (ray-hsdp quantize)
  write_bf16
  SECONDS=0
  [ -d "$MODELS/wan14b-fp8" ] || python -m ray_hsdp.cli quantize "$MODELS/wan14b" "$MODELS/wan14b-fp8" 2>&1 | tail -2
  echo "fp8 folder: ${SECONDS}s"
}
