"""The group's kernel settings (a part of ``GroupConfig``): what speeds a forward and a decode up,
and where compiled code is kept."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class GroupKernels(BaseModel):
    """What speeds a forward and a decode up: attention backend, compile, FP8, streams, VAE tiling."""

    attention_backend: str = Field(
        "auto",
        description="diffusers attention backend of the transformers ('native', '_native_cudnn', 'flash', 'sage' "
        "(SageAttention 2, built on the GPU host: docs/attention.md; its V quantization turns a channel that is "
        "zero at every key into NaN, so under it cross-attentions keep torch's SDPA), ...), or this project's "
        "'fa3_fp8' (FlashAttention 3's FP8 forward on Hopper, built on the GPU host: docs/attention.md; "
        "self-attentions only); 'auto' keeps diffusers' default, or '_native_cudnn' on CUDA when ring_degree > 1.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the transformers' repeated blocks on every rank (regional compile, in place, "
        "the gathers left eager); the group compiles with a warm-up request per lane before it serves (with "
        "lane_sizes, per lane size on every lane: each size compiles graphs of its own; of as many steps as reach "
        "every expert of a two-expert model), and each new request shape compiles again once.",
    )
    compile_cache_dir: str | None = Field(
        None,
        description="A folder for compile's caches, set on every rank before anything compiles (inductor's FX graph "
        "and AOTAutograd caches, Triton's kernels): a start of the same model, options and torch version whose "
        "ranks find it (a rebuild, a new group on another node of a shared volume, a new container) reuses what "
        "an earlier start compiled, and dynamo's tracing is all that runs again. Unset: torch's default, a "
        "folder under the host's temporary directory.",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="'fp8': the sharded diffusers models' linear layers inside their units keep, gather and "
        "multiply their weights in FP8 (e4m3, one scale per output row, activations scaled per token): half the "
        "weights per GPU and per gather, FP8 matmuls, outputs that drift from bfloat16; with shard_size 1 the same "
        "linears, whole on the rank. CUDA GPUs of compute capability 8.9 or above (H100, L40S), with gather "
        "'in_place' when sharded; the group's start compiles the activations' scaling.",
    )
    request_streams: bool = Field(
        False,
        description="CUDA: run each request's own work (scheduler steps, VAE decode) on a stream of its own, "
        "so that a rank's decode overlaps the group's forwards instead of queueing ahead of them; the forwards "
        "and the group's NCCL collectives then run on streams of the highest priority, so that the decode yields "
        "to them (the other ranks wait at each tick for this rank's forward, never for its decode).",
    )
    vae_tiling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode with the VAE's tiling (diffusers' enable_tiling): less memory, slower. "
        "'auto': for frames larger than vae_tiling_above_pixels.",
    )
    vae_parallel: Literal["auto", "on", "rows", "off"] = Field(
        "off",
        description="Lanes of several ranks share the VAE's decode. 'on': each rank decodes some of the tiles of "
        "diffusers' tiled decode and the leader blends them (frames equal to the one-rank tiled decode), for every "
        "request whose frames make more than one tile; 'auto': so on lanes of 4 or more ranks, and on smaller lanes "
        "where the decode is tiled anyway (vae_tiling); 'rows': each rank decodes one band of the picture's rows of "
        "the whole, untiled decode, its neighbours lending the rows its convolutions read across the band's edges "
        "(frames equal to the leader's untiled decode; a VAE whose policy has no row split, or a picture with fewer "
        "latent rows than the lane has ranks, decodes on the leader alone); 'off' (the default): the leader decodes "
        "alone.",
    )
    vae_tiling_above_pixels: int = Field(
        1280 * 720,
        ge=1,
        description="'auto' tiles the decode of frames larger than this (width x height).",
    )
    vae_channels_last: bool = Field(
        False,
        description="Keep the VAE's 3D convolution weights in channels-last memory (NDHWC), so that cuDNN runs "
        "its channels-last kernels on a video VAE's decode without transposing; the convolutions' summation "
        "order changes, so frames differ from the default by rounding.",
    )


# Attention backends (once ``attention_backends``): Facts about the attention backends a transformer
# may run (diffusers' names, and this project's ``fa3_fp8``): which return the log-sum-exp ring
# attention needs, which run without CUDA, which take no attention mask. Plain names, no kernels:
# the table of refusals (``ray_hsdp.config.pairs``) and the sharding code
# (``sharding.context_parallel``) both read them.

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
