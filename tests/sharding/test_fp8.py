"""FP8 linears over 2 gloo ranks: each rank quantizes its own rows, the in-place gathers carry FP8,
and the sharded model computes what the unsharded model quantized the same way computes.

Served groups refuse FP8 on CPU (it is slower than float32 here); torch's CPU ``_scaled_mm``
still runs, so the quantization, the gathers and the forward are checked here at module level.
"""

import copy

import pytest
import torch
from support import wan_transformer_inputs

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.sharding.fp8 import FP8, Fp8Linear, check_fp8_device, fp8_linears, quantize_fp8


def _wan():
    """The tiny Wan transformer of ``make-tiny``: its linears' sides are multiples of 16, as FP8
    matmuls need."""
    from diffusers import WanTransformer3DModel

    from ray_hsdp.checkpoints.architectures import get_architecture
    from ray_hsdp.checkpoints.random_weights import transformer_kwargs

    model = WanTransformer3DModel(**transformer_kwargs(get_architecture("wan2.1-t2v-14b"), tiny=True))
    # (Spelled out: this runs in a gloo worker, which cannot import the tests' support module.)
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, model.config.text_dim),
    )
    return model.eval(), inputs


def fp8_shard_and_compare(mesh, rank):
    from ray_hsdp.memory import unit_memory
    from ray_hsdp.sharding import resolve_plan, shard_module

    torch.manual_seed(0)
    model, inputs = _wan()

    def output(m):
        with torch.no_grad():
            return m(**inputs, return_dict=False)[0].detach().clone()

    reference = output(model)
    whole = copy.deepcopy(model)
    swapped = fp8_linears(resolve_plan(whole, min_num_params=10**9))
    quantize_fp8(whole)
    unsharded = output(whole)

    plan = resolve_plan(model, min_num_params=10**9)
    fp8_linears(plan)
    sharded = shard_module(model, plan, mesh, gather="in_place", reshard_after_forward=True, forward_prefetch=1)
    before = unit_memory(sharded.unit_modules)
    quantize_fp8(model)
    sharded.activate()
    after = unit_memory(sharded.unit_modules)
    out = output(model)
    again = output(model)
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    return {
        "swapped": swapped,
        "linears": len(linears),
        "fp8_shards": all(m.weight.to_local().dtype == FP8 for m in linears),
        "unit_bytes": (sum(u["local"] for u in before.values()), sum(u["local"] for u in after.values())),
        "sharded_vs_unsharded": float((out - unsharded).abs().max()),
        "repeat_equal": bool(torch.equal(out, again)),
        "drift": float((unsharded - reference).abs().max() / reference.abs().max()),
    }


@pytest.fixture(scope="module")
def gloo_pair(ray_cluster):
    from gloo import GlooGroup

    with GlooGroup(2) as group:
        yield group


def test_fp8_shards_gather_and_match_the_unsharded_quantized_model(gloo_pair):
    for result in gloo_pair.run(fp8_shard_and_compare):
        assert result["swapped"] > 0 and result["linears"] == result["swapped"], result
        assert result["fp8_shards"], result
        before, after = result["unit_bytes"]
        assert after < 0.5 * before, result  # float32 rows became one byte each (norms and biases stay)
        # Row-wise scales need no other rank's rows: the gathered weights are the unsharded ones.
        assert result["sharded_vs_unsharded"] == 0.0, result
        assert result["repeat_equal"]
        assert 0 < result["drift"] < 0.1, result


def test_fp8_refused_on_cpu_with_its_message():
    with pytest.raises(ValueError, match="FP8 tensor cores"):
        GroupConfig(device="cpu", quantization="fp8")
    with pytest.raises(ValueError) as err:
        GroupConfig(quantization="fp8").resolve_device(cluster_has_gpus=False)
    assert str(err.value).startswith("quantization 'fp8' with device 'cpu': FP8 needs a CUDA GPU")
    with pytest.raises(ValueError, match="gathers them in place"):
        GroupConfig(quantization="fp8", gather="fsdp2")
    assert GroupConfig(quantization="fp8").resolve_device(cluster_has_gpus=True).gather == "in_place"
    with pytest.raises(ValueError, match="this rank runs on cpu"):
        check_fp8_device("cpu")


def test_a_rank_that_shards_nothing_quantizes_its_denoisers_linears_whole(tmp_path):
    """A group of one rank (``shard_size 1``) loads the pipeline whole; with FP8 its diffusers
    models get the very linears a sharded group's units hold, quantized whole: the transformer
    computes what the module-level whole quantization computes, and the text encoder is untouched."""
    from ray_hsdp.checkpoints.tiny import make_tiny
    from ray_hsdp.config.topology import ParallelDims
    from ray_hsdp.loading.steps import LoadFacts, load_parts
    from ray_hsdp.phases import Phases
    from ray_hsdp.sharding import resolve_plan

    folder = make_tiny(tmp_path / "tiny")
    min_num_params = GroupConfig().min_num_params
    facts = LoadFacts(
        dtype="float32", device="cpu", mesh=None, min_num_params=min_num_params, gather="in_place",
        reshard_after_forward=True, forward_prefetch=1, keep_gathered=0.0, allow_pickle=False, cache_hooks=None,
        quantization="fp8", fused={}, pipeline_cls=None,
    )  # fmt: skip
    parts = load_parts(folder, facts, ("transformer", "text_encoder"), dims=ParallelDims(1, 1), lane_mesh=None,
                       backend=None, compile=False, phases=Phases("load"))  # fmt: skip
    transformer = parts.pipe.transformer
    linears = [m for m in transformer.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.dtype == FP8 for m in linears)
    assert not any(isinstance(m, Fp8Linear) for m in parts.pipe.text_encoder.modules())

    reference = type(transformer).from_pretrained(folder / "transformer").eval()
    assert fp8_linears(resolve_plan(reference, min_num_params)) == len(linears)
    quantize_fp8(reference)
    torch.manual_seed(0)
    inputs = wan_transformer_inputs(transformer.config)
    with torch.no_grad():
        assert torch.equal(transformer(**inputs)[0], reference(**inputs)[0])


def test_fp8_is_allowed_on_a_group_of_one_rank():
    assert GroupConfig(quantization="fp8", shard_size=1, device="cuda").quantization == "fp8"
    assert GroupConfig(quantization="fp8", shard_size=1, gather="fsdp2", device="cuda").gather == "fsdp2"  # unused


def fp8_folder_shard_and_compare(mesh, rank, folder: str, source: str):
    """The transformer of an FP8 folder and of its source, each sharded over the pair: the first
    loads its rows in FP8 with every row's scale, the second quantizes its rows at the start."""
    from pathlib import Path

    from ray_hsdp.loading.components import model_index
    from ray_hsdp.loading.steps import LoadFacts, shard_component

    def load(path: str, stored: frozenset[str]):
        facts = LoadFacts(
            dtype="float32", device="cpu", mesh=mesh, min_num_params=GroupConfig().min_num_params,
            gather="in_place", reshard_after_forward=True, forward_prefetch=1, keep_gathered=0.0, allow_pickle=False,
            cache_hooks=None, quantization="fp8", fused={}, pipeline_cls=None, fp8_stored=stored,
        )  # fmt: skip
        module, _, stats = shard_component(Path(path) / "transformer", model_index(Path(path))["transformer"], facts,
                                           "transformer")  # fmt: skip
        return module, stats

    stored, stored_stats = load(folder, frozenset({"transformer"}))
    at_start, start_stats = load(source, frozenset())
    torch.manual_seed(0)
    # (Spelled out: this runs in a gloo worker, which cannot import the tests' support module.)
    inputs = dict(
        hidden_states=torch.randn(1, stored.config.in_channels, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, stored.config.text_dim),
    )
    with torch.no_grad():
        equal = torch.equal(stored(**inputs)[0], at_start(**inputs)[0])
    linears = [m for m in stored.modules() if isinstance(m, Fp8Linear)]
    return {
        "equal": equal,
        "fp8_shards": bool(linears) and all(m.weight.to_local().dtype == FP8 for m in linears),
        "whole_scales": all(m.weight_scale.shape == (1, m.out_features) for m in linears),
        "bytes_read": (stored_stats["bytes_read"], start_stats["bytes_read"]),
    }


def test_an_fp8_folder_s_rows_load_in_fp8_and_equal_quantizing_at_the_start(gloo_pair, tmp_path):
    from ray_hsdp.checkpoints.tiny import make_tiny
    from ray_hsdp.cli.quantize import write_fp8_folder

    source = make_tiny(tmp_path / "tiny")
    folder = tmp_path / "tiny-fp8"
    write_fp8_folder(source, folder, dtype="float32", min_num_params=GroupConfig().min_num_params,
                     shard_components=("transformer",), fused={})  # fmt: skip
    for result in gloo_pair.run(fp8_folder_shard_and_compare, str(folder), str(source)):
        assert result["equal"] and result["fp8_shards"] and result["whole_scales"], result
        stored_bytes, start_bytes = result["bytes_read"]
        # One byte per weight of this rank's rows (float32's four), plus every row's scale on each rank.
        assert stored_bytes < 0.6 * start_bytes, result
