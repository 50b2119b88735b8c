"""The attention kernels as custom ops (``ray_hsdp.sharding.attention_ops``): a compiled Wan block
under ``sage`` or ``fa3_fp8`` is one graph (no step cache: its hooks branch on data).

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
from ray_hsdp.sharding.apply import compile_forward
from ray_hsdp.sharding.context_parallel import keep_cross_attention_native


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


def compiled_breaks(model, inputs) -> tuple[torch.Tensor, int, int]:
    """``model``'s eager output, then its output with its blocks compiled (``compile_forward``),
    the graph breaks dynamo counted and the graphs it built."""
    from torch._dynamo.utils import counters  # (imported here: this runs on gloo ranks too)

    with torch.no_grad():
        eager = model(**inputs, return_dict=False)[0]
        for block in model.blocks:
            compile_forward(block)
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


@pytest.mark.parametrize("backend", ["sage", "fa3_fp8"])
def test_a_compiled_block_under_each_kernel_op_is_one_graph(registry, backend):
    model, inputs = _tiny_wan()
    name = attention_ops.install_sage(_stand_in_sage) if backend == "sage" else fa3_fp8.register()
    model.set_attention_backend(name)
    keep_cross_attention_native(model)
    _, breaks, graphs = compiled_breaks(model, inputs)
    assert breaks == 0 and graphs == 1, (breaks, dict(counters["graph_break"]))


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
    """On each of 2 gloo ranks: the tiny model under the sage op on a Ulysses lane of both, its
    blocks compiled; the graph breaks, and how far the compiled output is from the eager one."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_hsdp.sharding.context_parallel import enable_context_parallel
    from ray_hsdp.topology import LANE_MESH_DIM_NAMES

    dispatch._CAN_USE_SAGE_ATTN = True
    model, inputs = _tiny_wan()
    model.set_attention_backend(attention_ops.install_sage(_opaque(_sage_contract)))
    keep_cross_attention_native(model)
    lane = init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=LANE_MESH_DIM_NAMES)
    enable_context_parallel(model, lane, ring=1, ulysses=2, device="cpu", attention_backend=None)
    from torch._dynamo.utils import counters

    _, breaks, _ = compiled_breaks(model, inputs)
    return breaks, dict(counters["graph_break"])


def test_a_compiled_block_on_a_ulysses_lane_is_one_graph(ray_cluster):
    """The all-to-alls around the op stay in the block's graph (a process group is no op argument)."""
    from gloo import GlooGroup
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[_tiny_wan.__module__])  # (test modules travel by value)
    with GlooGroup(2) as group:
        for breaks, reasons in group.run(_ulysses_compiled):
            assert breaks == 0, reasons
