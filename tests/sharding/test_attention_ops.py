"""The attention kernels as custom ops (``ray_hsdp.sharding.attention_ops``): a compiled block of
Wan, Qwen-Image and FLUX.2 under ``sage`` or ``fa3_fp8`` is one graph, on one rank and on a Ulysses
lane (no step cache: its hooks branch on data).

SageAttention and FlashAttention 3 are CUDA builds. Here stand-ins follow their contracts in float32
and, as a compiled extension is, are opaque to dynamo (``torch._dynamo.disable``): called bare in a
compiled block they break its graph (diffusers' own ``sage`` backend, checked below), called
through the ops they do not. Their speed is measured on H200s (``bench/block_graph.py``)."""

import sys

import pytest
import torch
from diffusers.models import attention_dispatch as dispatch
from test_fa3_fp8 import _reference_kernel, _reference_module, _tiny_wan
from torch._dynamo.utils import counters

from ray_hsdp.sharding import attention_ops, fa3_fp8
from ray_hsdp.sharding.apply import compile_forward, repeated_blocks
from ray_hsdp.sharding.context_parallel import keep_cross_attention_native
from ray_hsdp.sharding.policies import qwen_image
from ray_hsdp.sharding.policy import registered_policy


def _sage_contract(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=None, return_lse=False):
    """SageAttention 2's ``sageattn`` by its contract (``NHD``: batch, tokens, heads, dim), in float32."""
    assert tensor_layout == "NHD" and not is_causal
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)
    return (out, scores.logsumexp(-1)) if return_lse else out


def _opaque(kernel):
    """``kernel`` as dynamo sees a compiled extension: a call it cannot trace. (A function, not a
    wrapped global, where it runs on gloo ranks: a disabled function does not travel.)"""
    return torch._dynamo.disable(kernel)


_stand_in_sage = _opaque(_sage_contract)
_opaque_fa3 = _opaque(_reference_kernel)


@pytest.fixture
def registry(monkeypatch):
    """diffusers' registry as it was, put back afterwards (it is the process's), with the
    package checks of the GPU builds passed."""
    monkeypatch.setattr(dispatch, "_CAN_USE_SAGE_ATTN", True)
    monkeypatch.setattr(dispatch, "_CAN_USE_FLASH_ATTN_3", True)
    monkeypatch.setattr(dispatch, "sageattn", _stand_in_sage)  # what diffusers' own backend calls
    fa3 = _reference_module()
    fa3.flash_attn_func = _opaque_fa3
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    table = dispatch._AttentionBackendRegistry
    saved = {name: dict(getattr(table, name)) for name in ("_backends", "_constraints", "_supported_arg_names")}
    parallel = set(table._supports_context_parallel)
    active = table._active_backend  # set_attention_backend sets the process's default too
    yield table
    table._active_backend = active
    for name, entries in saved.items():
        getattr(table, name).clear()
        getattr(table, name).update(entries)
    table._supports_context_parallel.clear()
    table._supports_context_parallel.update(parallel)


def _tiny_qwen_image():
    """A seeded Qwen-Image transformer and its inputs: 16 image tokens, a text of 8 without a mask
    (its pipeline drops a mask of all ones)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 8, 16),
        timestep=torch.tensor([1.0]), img_shapes=[(1, 4, 4)],
    )  # fmt: skip
    return model, inputs


def _tiny_flux2():
    """A seeded FLUX.2 transformer (a double-stream and a single-stream block) and its inputs."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
    ).eval()  # fmt: skip
    inputs = dict(
        hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 8, 16),
        timestep=torch.tensor([1.0]), guidance=torch.tensor([3.5]),
        img_ids=torch.randint(0, 4, (1, 16, 4)).float(), txt_ids=torch.zeros(1, 8, 4),
    )  # fmt: skip
    return model, inputs


#: A tiny model of each family whose blocks the ops must keep whole, by name.
TINY = {"wan": _tiny_wan, "qwen-image": _tiny_qwen_image, "flux.2": _tiny_flux2}


def compiled_breaks(model, inputs, backend: str = "inductor") -> tuple[torch.Tensor, int, int]:
    """``model``'s eager output, then its output with its blocks compiled (``compile_forward``;
    with another ``backend``, their ``forward`` compiled by it), the graph breaks dynamo counted
    and the graphs it built."""
    from torch._dynamo.utils import counters  # (imported here: this runs on gloo ranks too)

    with torch.no_grad():
        eager = model(**inputs, return_dict=False)[0]
        for block in repeated_blocks(model):
            if backend == "inductor":
                compile_forward(block)
            else:
                block.forward = torch.compile(block.forward, backend=backend)
        torch._dynamo.reset()
        counters.clear()
        compiled = model(**inputs, return_dict=False)[0]
    torch.testing.assert_close(compiled, eager, atol=2e-5, rtol=1e-4)
    return compiled, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def test_the_stand_in_kernel_breaks_a_compiled_function_called_bare():
    """The stand-in is as opaque as a compiled extension: without the op, its call ends the graph."""
    q = torch.randn(1, 8, 2, 4)
    counters.clear()
    torch.compile(lambda x: _stand_in_sage(x * 2, x, x) + 1)(q)
    assert sum(counters["graph_break"].values()) >= 1


def traceable(model) -> None:
    """What a rank does before it compiles ``model``'s blocks: its policy's ``traceable`` step."""
    policy = registered_policy(model)
    if policy is not None and policy.traceable is not None:
        policy.traceable()


@pytest.fixture
def diffusers_rope(monkeypatch):
    """diffusers' Qwen-Image rotation put back afterwards (its policy replaces it in the module)."""
    from diffusers.models.transformers import transformer_qwenimage

    monkeypatch.setattr(transformer_qwenimage, "apply_rotary_emb_qwen", transformer_qwenimage.apply_rotary_emb_qwen)
    return transformer_qwenimage.apply_rotary_emb_qwen


@pytest.mark.parametrize(
    "backend, family", [("sage", "wan"), ("fa3_fp8", "wan"), ("sage", "qwen-image"), ("sage", "flux.2")]
)
def test_a_compiled_block_under_each_kernel_op_is_one_graph(registry, diffusers_rope, backend, family):
    """One graph per block class (FLUX.2 has two), no break, the eager output. (Both ops share
    their diffusers backend's body, ``attention_ops.run_forward_op``: Wan runs each, the other
    models sage's.)"""
    model, inputs = TINY[family]()
    name = attention_ops.install_sage(_stand_in_sage) if backend == "sage" else fa3_fp8.register()
    model.set_attention_backend(name)
    keep_cross_attention_native(model)
    traceable(model)
    _, breaks, graphs = compiled_breaks(model, inputs)
    assert breaks == 0, dict(counters["graph_break"])
    assert graphs == len({type(b) for b in repeated_blocks(model)})


def test_qwen_image_rotates_in_real_arithmetic_as_diffusers_does_with_complex_numbers(diffusers_rope):
    """The policy's ``traceable`` step: the same rotation, to the bit in eager mode, in the
    processors' module from then on."""
    from diffusers.models.transformers import transformer_qwenimage

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 3, 16, generator=gen, dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(40, 8), torch.randn(40, 8, generator=gen) * 3)
    assert torch.equal(qwen_image.rotate_real(x, freqs), diffusers_rope(x, freqs, use_real=False))
    registered_policy(_tiny_qwen_image()[0]).traceable()
    assert transformer_qwenimage.apply_rotary_emb_qwen is qwen_image.rotate_real
    with pytest.raises(ValueError, match="complex frequencies"):
        qwen_image.rotate_real(x, (freqs.real, freqs.imag), use_real=True)


def test_diffusers_own_sage_backend_breaks_the_graph_at_every_attention(registry):
    """The measurement the op is for: diffusers' ``sage`` calls the kernel bare, and each block's
    self-attention ends a graph (two blocks, at least two breaks)."""
    model, inputs = _tiny_wan()
    model.set_attention_backend("sage")  # diffusers' registration, untouched by install_sage here
    keep_cross_attention_native(model)
    _, breaks, _ = compiled_breaks(model, inputs)
    assert breaks >= len(model.blocks)


def test_the_sage_op_runs_the_kernel_and_keeps_its_log_sum_exp(registry):
    attention_ops.install_sage(_stand_in_sage)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    out, lse = attention_ops.sage_backend(q, k, v, return_lse=True)
    expected, expected_lse = _stand_in_sage(q, k, v, return_lse=True)
    torch.testing.assert_close(out, expected)
    # In diffusers' (batch, tokens, heads), as its forward ops and fa3_fp8 return it.
    torch.testing.assert_close(lse, expected_lse.permute(0, 2, 1))
    with pytest.raises(ValueError, match="attention_backend 'sage' takes no attention mask"):
        attention_ops.sage_backend(q, k, v, attn_mask=torch.ones(1, 16, 16, dtype=torch.bool))


def _ulysses_compiled(mesh, rank):
    """On each of 2 gloo ranks, for each tiny model: under the sage op on a Ulysses lane of both,
    its blocks compiled (after its policy's ``traceable`` step); the graph breaks dynamo counted
    (the compiled output equals the eager one, or this raises)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_hsdp.config.topology import LANE_MESH_DIM_NAMES
    from ray_hsdp.sharding.context_parallel import enable_context_parallel

    dispatch._CAN_USE_SAGE_ATTN = True
    lane = init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=LANE_MESH_DIM_NAMES)
    from torch._dynamo.utils import counters

    breaks = {}
    for family, tiny in TINY.items():
        model, inputs = tiny()
        model.set_attention_backend(attention_ops.install_sage(_opaque(_sage_contract)))
        keep_cross_attention_native(model)
        enable_context_parallel(model, lane, ring=1, ulysses=2, device="cpu", attention_backend=None)
        traceable(model)
        # Graph breaks are dynamo's, whatever the backend: aot_eager spares inductor's C++ builds here.
        _, count, _ = compiled_breaks(model, inputs, backend="aot_eager")
        breaks[family] = (count, dict(counters["graph_break"]))
    return breaks


def test_a_compiled_block_of_each_model_on_a_ulysses_lane_is_one_graph(ray_cluster):
    """The all-to-alls around the op stay in the block's graph (a process group is no op argument)."""
    from gloo import GlooGroup
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[_tiny_wan.__module__])  # (test modules travel by value)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with GlooGroup(2) as group:
        for breaks in group.run(_ulysses_compiled):
            assert set(breaks) == set(TINY)
            assert all(count == 0 for count, _ in breaks.values()), breaks


def test_a_rank_that_compiles_qwen_image_takes_its_policys_traceable_step(tmp_path, diffusers_rope):
    """``load_parts`` with ``compile`` runs the policy's step before it compiles the blocks; without
    compile the model's code stays diffusers' own."""
    from diffusers.models.transformers import transformer_qwenimage

    from ray_hsdp.checkpoints.tiny import make_tiny
    from ray_hsdp.config.group import GroupConfig
    from ray_hsdp.config.topology import ParallelDims
    from ray_hsdp.loading.steps import LoadFacts, load_parts
    from ray_hsdp.phases import Phases

    folder = make_tiny(tmp_path / "qwen", arch="qwen-image")
    facts = LoadFacts(
        dtype="float32", device="cpu", mesh=None, min_num_params=GroupConfig().min_num_params, gather="in_place",
        reshard_after_forward=True, forward_prefetch=1, keep_gathered=0.0, allow_pickle=False, cache_hooks=None,
        quantization="none", fused={}, pipeline_cls=None,
    )  # fmt: skip
    for compile in (False, True):
        parts = load_parts(folder, facts, ("transformer",), dims=ParallelDims(1, 1), lane_mesh=None, backend=None,
                           compile=compile, phases=Phases("load"))  # fmt: skip
        rotate = transformer_qwenimage.apply_rotary_emb_qwen
        assert (rotate is qwen_image.rotate_real) is compile and parts.compiled_modules == (2 if compile else 0)
