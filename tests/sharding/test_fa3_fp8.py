"""FlashAttention 3's FP8 backend: the per-head quantization, and the backend's path through
diffusers' dispatcher. The FA3 kernel is Hopper-only; its speed and drift are measured on H200s
(``bench/results/attention-fa3-wan2.1-14b.md``). Here, where it cannot run, a reference that
follows its documented contract (attention over ``fp8 * descale``, log-sum-exp ``(batch, heads,
tokens)``) stands in for it, so that what this project adds (scales, descales, layouts, the
registration) is checked against torch's SDPA."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch as dispatch

from ray_hsdp.sharding import fa3_fp8
from ray_hsdp.sharding.fp8 import FP8, FP8_MAX


def test_each_head_is_scaled_by_its_own_largest_magnitude():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 3, 16, generator=gen) * torch.tensor([1.0, 100.0, 0.01])[None, None, :, None]
    x[1, :, 2] = 0  # a head with no signal at all
    q, descale = fa3_fp8.quantize_heads(x)
    assert q.dtype == FP8 and descale.shape == (2, 3) and descale.dtype == torch.float32
    amax = x.abs().amax(dim=(1, 3))
    torch.testing.assert_close(descale[amax > 0], amax[amax > 0] / FP8_MAX)
    back = q.float() * descale[:, None, :, None]
    assert torch.isfinite(back).all() and (back[1, :, 2] == 0).all()
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of its head's largest (a scale per
    # channel would do better on wide channels; a head's scale keeps a zero channel zero).
    assert ((back - x).abs() <= amax[:, None, :, None] / 16).all()
    assert (q.float().abs().amax(dim=(1, 3))[amax > 0] == FP8_MAX).all()


def test_install_refuses_a_process_without_a_hopper_gpu():
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU")
    with pytest.raises(ValueError, match="attention_backend 'fa3_fp8' needs a CUDA GPU"):
        fa3_fp8.install()


def _reference_kernel(q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                      return_attn_probs=False):  # fmt: skip
    """FlashAttention 3's ``flash_attn_func`` on FP8 inputs, by its contract, in float32."""
    assert q.dtype == k.dtype == v.dtype == FP8 and not causal
    q, k, v = (t.float() * d[:, None, :, None] for t, d in ((q, q_descale), (k, k_descale), (v, v_descale)))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(torch.bfloat16)
    return (out, scores.logsumexp(-1)) if return_attn_probs else out


def _reference_module() -> types.ModuleType:
    """A ``flash_attn_interface`` module holding the reference kernel (with a spec: importers of
    diffusers look packages up by it)."""
    module = types.ModuleType("flash_attn_interface")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn_interface", None)
    module.flash_attn_func = _reference_kernel
    return module


@pytest.fixture
def _registered(monkeypatch):
    """The backend registered over diffusers' ``_flash_3`` with the reference kernel, and
    diffusers' own registration put back afterwards (the registry is the process's)."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _reference_module())
    registry, name = dispatch._AttentionBackendRegistry, dispatch.AttentionBackendName(fa3_fp8.DIFFUSERS_NAME)
    saved = (registry._backends[name], registry._constraints[name], registry._supported_arg_names[name])
    had_parallel = name.value in registry._supports_context_parallel
    yield fa3_fp8.register()
    registry._backends[name], registry._constraints[name], registry._supported_arg_names[name] = saved
    if not had_parallel:
        registry._supports_context_parallel.discard(name.value)


def test_the_backend_runs_through_diffusers_dispatch_close_to_sdpa(_registered):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 96, 4, 32, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    k = k + 3 * torch.randn(1, 1, 4, 32, generator=gen, dtype=torch.bfloat16)  # keys share a mean, as real ones do
    assert dispatch.AttentionBackendName(_registered) in dispatch._AttentionBackendRegistry.list_backends()
    out = dispatch.dispatch_attention_fn(q, k, v, backend=_registered)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape

    def sdpa(*qkv):  # torch's attention on (batch, tokens, heads, dim), in float32
        return F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in qkv)).transpose(1, 2)

    # Equal (to bf16 rounding) to exact attention over the values the FP8 inputs stand for ...
    # (the keys without their mean: softmax is the same, FP8 resolves their differences better).
    smoothed = (q, k - k.mean(dim=1, keepdim=True), v)
    rounded = [t8.float() * d[:, None, :, None] for t8, d in (fa3_fp8.quantize_heads(t) for t in smoothed)]
    torch.testing.assert_close(out.float(), sdpa(*rounded), atol=4e-3, rtol=1e-2)
    # ... and near exact attention over the inputs (FP8 rounding of random inputs).
    diff = (out.float() - sdpa(q, k, v)).abs()
    assert diff.max() < 0.1 and diff.mean() < 0.01
    # The log-sum-exp a context-parallel template may ask the forward op for, in diffusers' layout.
    out, lse = fa3_fp8.fa3_fp8_attention(q, k, v, return_lse=True)
    exact_lse = (torch.einsum("bqhd,bkhd->bqhk", q.float(), k.float()) * 32**-0.5).logsumexp(-1)
    assert lse.shape == (1, 96, 4)  # diffusers' (batch, tokens, heads)
    torch.testing.assert_close(lse, exact_lse, atol=0.1, rtol=0.02)


def _tiny_wan():
    """A seeded two-head Wan transformer and its inputs (32 tokens: a Ulysses split of 2 fits)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 16),
    )
    return model, inputs


def _ulysses_lane_against_one_rank(mesh, rank):
    """On each of 2 gloo ranks: the tiny model's forward under the backend (reference kernel) on
    one rank, then on a Ulysses lane of both; and the native forward, to see FP8 at work."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_hsdp.config.topology import LANE_MESH_DIM_NAMES
    from ray_hsdp.sharding.context_parallel import enable_context_parallel, keep_cross_attention_native

    sys.modules["flash_attn_interface"] = _reference_module()
    dispatch._CAN_USE_FLASH_ATTN_3 = True  # diffusers' package check, false without the GPU build
    model, inputs = _tiny_wan()
    with torch.no_grad():
        native = model(**inputs, return_dict=False)[0]
        model.set_attention_backend(fa3_fp8.register())
        keep_cross_attention_native(model)
        one = model(**inputs, return_dict=False)[0]
        lane = init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=LANE_MESH_DIM_NAMES)
        enable_context_parallel(model, lane, ring=1, ulysses=2, device="cpu", attention_backend=None)
        split = model(**inputs, return_dict=False)[0]
    return float((split - one).abs().max()), float((one - native).abs().max())


def test_a_ulysses_lane_under_the_backend_equals_one_rank(ray_cluster):
    """diffusers' all-to-all hands each rank whole sequences of its heads, so each head's scales
    and mean key are the one-rank run's, and the lane's output equals it (float level), while
    both differ from exact attention by FP8's rounding."""
    from gloo import GlooGroup

    with GlooGroup(2) as group:
        for lane_vs_one, fp8_vs_native in group.run(_ulysses_lane_against_one_rank):
            assert lane_vs_one < 1e-5
            assert fp8_vs_native > 1e-4  # the FP8 backend ran, not the native one
