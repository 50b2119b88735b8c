import pytest
from pydantic import ValidationError

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.request import parse_size


def test_defaults_are_a_usable_group():
    config = GroupConfig()
    assert config.mode == "batch"
    assert config.resolved_shard_size == 2
    assert config.served_model_name == "tiny-wan"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"shard_size": 0}, "shard_size must be >= 1"),
        ({"shard_size": -3}, "shard_size must be >= 1"),
        ({"replicate_size": 0}, "greater than or equal to 1"),
        ({"world_size": 4, "replicate_size": 2, "shard_size": 4}, "2 x 4 != 4"),
        ({"world_size": 6, "replicate_size": 4}, "not divisible by replicate_size=4"),
        ({"mode": "sequence"}, "'batch' or 'replicated'"),
        ({"device": "tpu"}, "'auto', 'cuda' or 'cpu'"),
        ({"dtype": "int8"}, "'auto', 'float32', 'bfloat16' or 'float16'"),
        ({"shard_components": ()}, "at least one pipeline component"),
        ({"model": ""}, "model must name"),
        ({"shard_sise": 2}, "Extra inputs are not permitted"),
        ({"collective_timeout_s": 0}, "greater than 0"),
        ({"requests_per_rank": 9}, "less than or equal to 8"),
        ({"ulysses_degree": 2, "shard_components": ("transformer", "vae")}, "leave 'vae' out"),
        ({"cpus_per_rank": 0}, "greater than 0"),
        ({"keep_gathered": 1.5}, "keep_gathered\n.*less than or equal to 1"),
        ({"attention_backend": "sage", "device": "cpu"}, "attention_backend naming a CUDA kernel.*with device 'cpu'"),
        (
            {"attention_backend": "fa3_fp8", "device": "cpu"},
            "attention_backend naming a CUDA kernel.*with device 'cpu'",
        ),
        (
            {"attention_backend": "fa3_fp8", "device": "cuda", "shard_size": 2, "ring_degree": 2},
            r"ring_degree > 1 with attention_backend other than auto, _native_cudnn, _native_flash",
        ),
        (
            {"attention_backend": "sage", "device": "cuda", "shard_size": 2, "ring_degree": 2},
            r"ring_degree > 1 with attention_backend other than auto, _native_cudnn, _native_flash \(e.g. sage\)",
        ),
        ({"shard_size": 2, "vae_parallel": "rows", "vae_tiling": "on"}, "vae_tiling 'on' with vae_parallel 'rows'"),
    ],
)
def test_bad_group_config_names_the_problem(fields, message):
    with pytest.raises(ValidationError, match=message):
        GroupConfig(**fields)


def test_world_size_resolves_shard_size():
    assert GroupConfig(world_size=8, replicate_size=2).resolved_shard_size == 4
    assert GroupConfig(world_size=4, replicate_size=2, shard_size=2).resolved_shard_size == 2


def test_auto_device_and_dtype():
    gpu = GroupConfig().resolve_device(cluster_has_gpus=True)
    cpu = GroupConfig().resolve_device(cluster_has_gpus=False)
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16")
    assert (cpu.device, cpu.dtype) == ("cpu", "float32")
    assert GroupConfig(device="cpu", dtype="bfloat16").resolve_device(True).device == "cpu"


def test_auto_tick_exchange_is_the_host():
    assert GroupConfig().resolve_device(cluster_has_gpus=True).tick_exchange == "host"
    assert GroupConfig().resolve_device(cluster_has_gpus=False).tick_exchange == "host"
    assert GroupConfig(tick_exchange="device").resolve_device(True).tick_exchange == "device"


def test_auto_gather_is_in_place_on_cuda_and_fsdp2_on_cpu():
    assert GroupConfig().resolve_device(cluster_has_gpus=True).gather == "in_place"
    assert GroupConfig().resolve_device(cluster_has_gpus=False).gather == "fsdp2"
    assert GroupConfig(reshard_after_forward=False).resolve_device(True).gather == "fsdp2"
    assert GroupConfig(device="cpu", gather="in_place").resolve_device(False).gather == "in_place"
    with pytest.raises(ValueError, match="gather 'in_place' with reshard_after_forward False: in-place gathers free"):
        GroupConfig(gather="in_place", reshard_after_forward=False)


@pytest.mark.parametrize("size", ["64", "64x", "x64", "axb", "64x64x5", "-64x64", "65x64", "64x8", "0x0"])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError):
        parse_size(size)


def test_parse_size_accepts_width_then_height():
    assert parse_size("96x64") == (96, 64)
    assert parse_size("832X480") == (832, 480)


def test_app_config_checks_default_size():
    with pytest.raises(ValidationError, match="multiples of 16"):
        AppConfig(default_size="100x100")
    with pytest.raises(ValidationError, match="exceeds max_pixels"):
        AppConfig(default_size="1024x1024", max_pixels=512 * 512)


def test_parallel_dims_bundles_and_mesh():
    dims = ParallelDims(replicate_size=2, shard_size=4)
    assert dims.world_size == 8
    assert dims.lane_mesh_shape == (4, 1, 1, 1)  # batch mode: lanes of one rank
    combined = ParallelDims(replicate_size=1, shard_size=8, cfg=2, ulysses=2)
    assert (combined.lane_size, combined.num_lanes, combined.lane_mesh_shape) == (4, 2, (2, 2, 1, 2))
    assert [combined.lane_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [combined.cfg_index(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r for r in range(8) if combined.leads(r)] == [0, 4]
    replicated = ParallelDims(replicate_size=1, shard_size=4, replicated=True)
    assert (replicated.lane_size, replicated.num_lanes, replicated.lane_mesh_shape) == (4, 1, None)
    assert dims.bundles("cuda", 2) == [{"GPU": 1.0, "CPU": 2.0}] * 4
    assert dims.bundles("cpu", 0.5) == [{"CPU": 0.5}] * 4  # a fraction of a CPU pins a gloo rank
    with pytest.raises(ValueError):
        ParallelDims(0, 2)


def test_cpu_ranks_take_half_a_cpu_unless_told_and_gpu_ranks_one():
    assert GroupConfig().resolve_device(cluster_has_gpus=False).cpus_per_rank == 0.5
    assert GroupConfig().resolve_device(cluster_has_gpus=True).cpus_per_rank == 1.0
    assert GroupConfig(cpus_per_rank=2).resolve_device(cluster_has_gpus=False).cpus_per_rank == 2
    # The usp YAML's group of 4 CPU ranks fits a 2-core machine.
    dims = GroupConfig(ulysses_degree=2, shard_size=4).parallel_dims()
    assert sum(b["CPU"] for b in dims.bundles("cpu", 0.5)) == 2


def test_a_group_no_node_can_hold_fails_at_once_with_what_it_needs_and_the_fix(ray_cluster):
    from ray_hsdp.group import GroupUnplaceableError, check_placeable
    from ray_hsdp.serve import build_app

    with pytest.raises(GroupUnplaceableError, match=r"needs 8 x \{'CPU': 1.0\}.*cpus_per_rank: 0.5"):
        check_placeable(ParallelDims(1, 8).bundles("cpu", 1.0))
    with pytest.raises(GroupUnplaceableError, match="a smaller shard_size"):
        check_placeable(ParallelDims(1, 2).bundles("cuda", 1.0))
    check_placeable(ParallelDims(1, 8).bundles("cpu", 0.5))  # fits one node of 4 CPUs
    with pytest.raises(GroupUnplaceableError, match="cpus_per_rank"):
        build_app({"model": "tiny", "device": "cpu", "shard_size": 8, "cpus_per_rank": 1})


def test_the_configuration_page_is_generated_from_the_models():
    """docs/configuration.md is what ``python -m ray_hsdp.config.docs`` writes: every field, its
    default and its description, so the page cannot drift from the code."""
    from pathlib import Path

    from ray_hsdp.config.docs import markdown

    page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert page.read_text() == markdown(), "docs/configuration.md is stale: python -m ray_hsdp.config.docs > it"


def test_the_rank_pool_is_ray_s_preload_and_its_idle_worker_limit():
    from ray_hsdp.config.group import RANK_MODULES, rank_pool_env

    preload = {"RAY_preload_python_modules": ",".join(RANK_MODULES)}
    assert rank_pool_env(None) == preload  # Ray's own count of idle workers
    assert rank_pool_env(3) == {**preload, "RAY_num_workers_soft_limit": "3"}
    assert rank_pool_env(0) == {}  # off: each rank imports at its start


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"sample_solver": "unipc", "lora_defaults": {"d": {"sigmas": [1.0, 0.5]}}}, "sigmas with sample_solver unipc"),
        ({"max_steps": 2, "lora_defaults": {"d": {"sigmas": [1.0, 0.75, 0.5]}}}, r"\(its sigmas\) exceeds max_steps=2"),
        ({"lora_defaults": {"d": {"sigmas": [1.0, 0.5], "num_inference_steps": 4}}}, "the steps are the sigmas' count"),
        ({"lora_defaults": {"d": {"sigmas": [0.5, 1.0]}}}, "sigmas must fall"),
    ],
)
def test_an_adapters_schedule_the_deployment_cannot_run_is_refused_at_start(fields, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig(model="tiny", loras={"d": "tiny-detail"}, **fields)
