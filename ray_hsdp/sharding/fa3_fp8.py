"""FlashAttention 3's FP8 forward as a diffusers attention backend (``attention_backend: fa3_fp8``).

FlashAttention 3 (the ``hopper/`` build of Dao-AILab/flash-attention, ``flash_attn_interface``;
``docs/attention.md`` says how to build it) multiplies e4m3 queries, keys and values on Hopper's
FP8 tensor cores, each (batch, head) with its own descale. At Wan2.1-14B's 40 heads x 128 on one
H200 it was the fastest attention measured (``bench/results/attention-fa3-wan2.1-14b-H200.md``): 1.44x
torch's SDPA at 32,760 tokens and 1.55x at 75,600, where SageAttention 2 gave 1.29x and 1.44x.

Each of q, k and v is scaled per (batch, head) by its largest magnitude over the tokens and the
head's channels: one scale over all channels, so a channel that is zero at every key stays zero
(SageAttention's per-channel V scale turns it into NaN, ``context_parallel.PER_CHANNEL_V_BACKENDS``).
Under Ulysses the all-to-all hands each rank whole sequences of some heads, so a lane's scales are
the unsharded run's and its output equals the one-rank FP8 output (checked on CPU with a reference
of the kernel, ``tests/sharding/test_fa3_fp8.py``). Ring attention would scale
each rank's chunk of keys alone; it is refused with every backend outside ``RING_BACKENDS``.

diffusers names its backends by an enum that cannot grow and has no public way to register one;
so ``install`` registers ``fa3_fp8_attention`` in the rank's process under the enum's ``_flash_3``
(the same package's bf16 kernel, which diffusers registers without context parallel), through
diffusers' ``_AttentionBackendRegistry`` and ``_templated_context_parallel_attention`` (the Ulysses
all-to-all around a forward op, as its own ``sage`` backend does): ``attention_ops.register_backend``.
The kernel call alone is a torch custom op (``attention_ops.fa3_fp8_attention``): the quantization
around it stays in the compiled block's graph.
"""

from __future__ import annotations

import importlib.util

import torch

from ray_hsdp.config.kernels import FA3_FP8
from ray_hsdp.sharding import attention_ops
from ray_hsdp.sharding.fp8 import FP8, FP8_MAX

#: The project's name for the backend (``attention_backend``).
NAME = FA3_FP8
#: The diffusers backend name it is registered under in a rank's process.
DIFFUSERS_NAME = "_flash_3"
#: FlashAttention 3's FP8 kernels are Hopper's (compute capability 9.0).
CAPABILITY = (9, 0)
#: A head whose values are all zero gets this scale instead of 0 (0 / 0 would be NaN).
TINY_AMAX = 1e-12


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (batch, tokens, heads, dim) in e4m3, and each (batch, head)'s float32 descale
    (``x ~= fp8 * descale``): the largest magnitude of the head's tokens and channels maps to
    e4m3's largest value."""
    descale = x.abs().amax(dim=(1, 3)).float().clamp(min=TINY_AMAX) / FP8_MAX
    return (x.float() / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), descale


def _forward_op(
    ctx,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config=None,
):
    """Attention over whole sequences (``(batch, tokens, heads, dim)``, diffusers' layout and
    FlashAttention's): the signature of diffusers' forward ops, which its Ulysses all-to-all calls."""
    if attn_mask is not None or dropout_p or enable_gqa:
        raise ValueError("attention_backend 'fa3_fp8' takes no attention mask, dropout or grouped queries")
    # Softmax does not change when a query's scores all shift by one amount, so each key may lose
    # its head's mean key (SageAttention's smoothing): the keys' spread, which FP8 must resolve,
    # shrinks to their differences. Under Ulysses each rank holds whole sequences: the same mean.
    key_mean = key.mean(dim=1, keepdim=True)
    (q, q_descale), (k, k_descale), (v, v_descale) = (quantize_heads(t) for t in (query, key - key_mean, value))
    out, lse = torch.ops.ray_hsdp.fa3_fp8_attention(
        q, k, v, q_descale, k_descale, v_descale, scale, is_causal, return_lse
    )
    out = out.to(query.dtype)
    if not return_lse:
        return out
    # FlashAttention's log-sum-exp is (batch, heads, tokens); diffusers' ops return (batch, tokens,
    # heads), of the scores before the shift taken out above.
    shift = (query.float() * key_mean.float()).sum(-1) * (scale if scale is not None else query.shape[-1] ** -0.5)
    return out, lse.permute(0, 2, 1) + shift


def fa3_fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    _parallel_config=None,
):
    """The backend diffusers' dispatcher calls (``attention_ops.run_forward_op``): the forward op
    alone, or inside diffusers' context-parallel template."""
    return attention_ops.run_forward_op(
        _forward_op, query, key, value, attn_mask, is_causal, scale, return_lse, _parallel_config
    )


def install() -> str:
    """Checks that this process can run the backend, registers it with diffusers (``register``)
    and returns the diffusers backend name models take for it.

    Raises:
        ValueError: No CUDA GPU, not a Hopper GPU, FlashAttention 3 not installed, or a diffusers
            without the registry this relies on; each names ``attention_backend 'fa3_fp8'``.
    """
    if not torch.cuda.is_available():
        raise ValueError(f"attention_backend {NAME!r} needs a CUDA GPU; this process sees none")
    capability = torch.cuda.get_device_capability()
    if capability != CAPABILITY:
        raise ValueError(
            f"attention_backend {NAME!r} runs FlashAttention 3's FP8 kernels, built for Hopper (compute "
            f"capability 9.0); this GPU has {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("flash_attn_interface") is None:
        raise ValueError(
            f"attention_backend {NAME!r} needs FlashAttention 3 (flash_attn_interface), built from the "
            "hopper/ folder of Dao-AILab/flash-attention: docs/attention.md"
        )
    return register()


def register() -> str:
    """Registers ``fa3_fp8_attention`` with diffusers' dispatcher in this process, under
    ``DIFFUSERS_NAME`` and with context parallel (again is harmless), its op calling FlashAttention
    3's kernel; returns that name.

    Raises:
        ValueError: This diffusers has no registry or context-parallel template to use.
    """
    from flash_attn_interface import flash_attn_func

    attention_ops.KERNELS[NAME] = flash_attn_func
    return attention_ops.register_backend(DIFFUSERS_NAME, fa3_fp8_attention)
