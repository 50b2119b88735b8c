"""Facts about the attention backends a transformer may run (diffusers' names, and this project's
``fa3_fp8``): which return the log-sum-exp ring attention needs, which run without CUDA, which take
no attention mask. Plain names, no kernels: the table of refusals (``ray_hsdp.pairs``) and the
sharding code (``sharding.context_parallel``) both read them."""

#: This project's FlashAttention 3 FP8 forward (``sharding.fa3_fp8``).
FA3_FP8 = "fa3_fp8"

#: Backends of this project's own, beside diffusers' names.
PROJECT_BACKENDS = (FA3_FP8,)

#: Attention backends that return the log-sum-exp ring attention merges partial results with.
RING_BACKENDS = ("_native_cudnn", "_native_flash")

#: Backends that run without CUDA (PyTorch's SDPA and its math kernel).
CPU_BACKENDS = ("native", "_native_math")

#: Backends that quantize V with one FP8 scale per channel over all keys (SageAttention 2's
#: ``per_channel_fp8`` multiplies by 448 / the channel's largest value): a channel that is zero at
#: every key gives 0 x inf, and the NaN reaches every channel at the attention's output projection.
#: A cross-attention over a short text can hold one: on Wan2.1-14B with FP8 linears the empty
#: negative prompt (one token among 226 keys, the rest zero padding) had a channel zero at every key
#: in one block, and every frame came out NaN
#: (``bench/results/finite-wan2.1-t2v-14b-1xH200-fp8-sage-cause.md``; sm89 / sm90 kernels).
PER_CHANNEL_V_BACKENDS = ("sage", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90")

#: Backends under which cross-attentions keep torch's SDPA: ``PER_CHANNEL_V_BACKENDS`` (NaN), and
#: ``fa3_fp8``, whose FP8 would add drift there for little time (a text of a few hundred keys).
CROSS_ATTENTION_NATIVE = (*PER_CHANNEL_V_BACKENDS, FA3_FP8)

#: Backends whose kernels take no attention mask (diffusers' functions raise on one; ``fa3_fp8``
#: likewise): a transformer that passes a mask to its attention cannot run on them.
MASKLESS_BACKENDS = (
    "flash",
    "_flash_3",
    "_native_flash",
    "sage",
    "_sage_qk_int8_pv_fp8_cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton",
    FA3_FP8,
)
