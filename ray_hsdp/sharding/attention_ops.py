"""The fast attention kernels as torch custom ops, so that a compiled transformer block is one graph.

Dynamo cannot trace into a compiled extension: every call of SageAttention's ``sageattn`` (or of
FlashAttention 3's ``flash_attn_func``) inside a ``torch.compile``d block ends the graph there and
starts another after it, once per attention, with the eager Python between. Registered with
``torch.library.custom_op`` and a fake (meta) implementation, the kernel call is one opaque node
of the block's graph instead: inductor compiles and fuses everything around it (the norms, RoPE,
fa3_fp8's per-head quantization, the Ulysses all-to-alls, which stay traceable outside the op).

Only the kernel call is wrapped. Each op takes the kernel's arguments and returns ``(out, lse)``
(an empty ``lse`` when it was not asked for): a custom op returns a fixed number of tensors.
The kernel an op calls is looked up when it runs (``KERNELS``), so that a process without the
GPU build (a CPU test) can stand a reference in for it.

``install_sage`` registers diffusers' ``sage`` backend anew around the op (diffusers' own calls
``sageattn`` directly), as ``fa3_fp8.register`` registers ``fa3_fp8``; with Ulysses, diffusers'
context-parallel template calls the op's forward inside its all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The kernel each op calls, by op: set where the backend is installed (``install_sage``,
#: ``fa3_fp8.register``), from the kernel's package or a stand-in of it.
KERNELS: dict[str, Callable] = {}

#: The diffusers backend name ``install_sage`` registers.
SAGE = "sage"


def _empty_lse(query: torch.Tensor) -> torch.Tensor:
    return query.new_empty((0,), dtype=torch.float32)


def _lse_like(query: torch.Tensor) -> torch.Tensor:
    """A fake log-sum-exp of ``query`` (``(batch, tokens, heads, dim)``): ``(batch, heads, tokens)``."""
    batch, tokens, heads, _ = query.shape
    return query.new_empty((batch, heads, tokens), dtype=torch.float32)


@torch.library.custom_op("ray_hsdp::sage_attention", mutates_args=())
def sage_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SageAttention's ``sageattn`` on ``(batch, tokens, heads, dim)`` (its ``NHD`` layout):
    ``(out, lse)``, the log-sum-exp ``(batch, heads, tokens)`` as sage returns it."""
    result = KERNELS[SAGE](
        q=query, k=key, v=value, tensor_layout="NHD", is_causal=is_causal, sm_scale=scale, return_lse=return_lse
    )
    # Contiguous, as the fake says: inductor checks the strides (a copy only where a kernel's are not).
    if return_lse:
        out, lse, *_ = result
        return out.contiguous(), lse.float().contiguous()
    return result.contiguous(), _empty_lse(query)


@sage_attention.register_fake
def _sage_attention_fake(query, key, value, is_causal, scale, return_lse):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, _lse_like(query) if return_lse else _empty_lse(query)


@torch.library.custom_op("ray_hsdp::fa3_fp8_attention", mutates_args=())
def fa3_fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    scale: float | None,
    is_causal: bool,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention 3's ``flash_attn_func`` on e4m3 ``(batch, tokens, heads, dim)`` with each
    (batch, head)'s descale: ``(out, lse)``, out in bf16, the log-sum-exp ``(batch, heads, tokens)``."""
    result = KERNELS["fa3_fp8"](
        query, key, value, softmax_scale=scale, causal=is_causal,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, return_attn_probs=return_lse,
    )  # fmt: skip
    out, lse = result if isinstance(result, tuple) else (result, None)
    return out.contiguous(), lse.float().contiguous() if return_lse else _empty_lse(query)


@fa3_fp8_attention.register_fake
def _fa3_fp8_attention_fake(query, key, value, q_descale, k_descale, v_descale, scale, is_causal, return_lse):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]), dtype=torch.bfloat16)
    return out, _lse_like(query) if return_lse else _empty_lse(query)


def _sage_forward_op(
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
    """The signature of diffusers' forward ops (its context-parallel template calls it between
    its all-to-alls); the log-sum-exp in diffusers' ``(batch, tokens, heads)``."""
    if attn_mask is not None or dropout_p or enable_gqa:
        raise ValueError("attention_backend 'sage' takes no attention mask, dropout or grouped queries")
    out, lse = torch.ops.ray_hsdp.sage_attention(query, key, value, is_causal, scale, return_lse)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("the attention custom ops are forward (inference) kernels only")


def run_forward_op(forward_op: Callable, query, key, value, attn_mask, is_causal, scale, return_lse, parallel):
    """A diffusers backend's body: ``forward_op`` alone, or inside diffusers' context-parallel
    template (the Ulysses all-to-alls around it) when the attention's processor holds a parallel
    config (``parallel``)."""
    if parallel is None:
        return forward_op(None, query, key, value, attn_mask, 0.0, is_causal, scale, False, return_lse)
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(
        query, key, value, attn_mask, 0.0, is_causal, scale, False, return_lse,
        forward_op=forward_op, backward_op=_backward_op, _parallel_config=parallel,
    )  # fmt: skip


def sage_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    _parallel_config=None,
):
    """diffusers' ``sage`` backend through the op (``run_forward_op``), as diffusers' own runs sage."""
    parallel = _parallel_config
    return run_forward_op(_sage_forward_op, query, key, value, attn_mask, is_causal, scale, return_lse, parallel)


def register_backend(name: str, backend: Callable) -> str:
    """Registers ``backend`` with diffusers' dispatcher under its backend ``name``, with context
    parallel, in this process (again is harmless); returns ``name``.

    diffusers names its backends by an enum and has no public way to register one: this goes
    through its private ``_AttentionBackendRegistry``, checked here so that a diffusers without it
    fails at start with a message, not a forward later.

    Raises:
        ValueError: This diffusers has no registry or context-parallel template to use.
    """
    from diffusers.models import attention_dispatch as dispatch

    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    if registry is None or not hasattr(dispatch, "_templated_context_parallel_attention"):
        raise ValueError(f"attention backend {name!r}: this diffusers has no attention registry to register it in")
    registry.register(dispatch.AttentionBackendName(name), constraints=[], supports_context_parallel=True)(backend)
    return name


def install_sage(kernel: Callable | None = None) -> str:
    """Registers diffusers' ``sage`` backend around ``sage_attention`` in this process, calling
    ``kernel`` (default: SageAttention's ``sageattn``); returns the backend's name.

    Raises:
        ValueError: SageAttention is not installed here (``ray-hsdp build-kernels sage``), or
            this diffusers has no registry to register it in.
    """
    if kernel is None:
        try:
            from sageattention import sageattn as kernel
        except ImportError as err:
            raise ValueError(
                "attention_backend 'sage' needs SageAttention 2 (sageattention): `ray-hsdp build-kernels sage` "
                f"builds its wheel for this GPU (docs/attention.md); importing it failed: {err}"
            ) from None
    KERNELS[SAGE] = kernel
    return register_backend(SAGE, sage_backend)
