"""Loading a pipeline as a short list of named steps, each a function of the facts it needs (as
torchtitan's ``parallelize`` applies its steps to a model).

Each sharded component, in this order (``shard_component``): build on the meta device, put the
step cache's hooks on, plan its units (FP8 linears swapped in), shard, materialise and read this
rank's slices, fuse adapters into its rows, quantize them, activate the gathers. Then the pipeline
(``load_parts``): the other components (and the adapters fused into them), on a rank that shards
nothing the FP8 linears, the attention backend or context parallel, compile, the CFG split.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.loading.components import (
    build_on_meta,
    fill_from_checkpoint,
    load_pipeline,
    materialize,
    model_index,
    model_key_names,
)
from ray_hsdp.loading.fp8_folder import check_stored_linears
from ray_hsdp.phases import Phases
from ray_hsdp.sharding import compile_repeated_blocks, compile_units, resolve_plan, shard_module, step_cache
from ray_hsdp.sharding.context_parallel import LaneParallel, enable_context_parallel, set_attention_backend
from ray_hsdp.sharding.fp8 import compile_fp8_scaling, expect_stored_fp8, fp8_linears, quantize_fp8
from ray_hsdp.sharding.policy import registered_policy

logger = logging.getLogger("ray_hsdp")

#: Adapters merged at load: name -> (scale, component -> LoRA file or folder).
FusedLoras = Mapping[str, tuple[float, Mapping[str, Path]]]


@dataclass(frozen=True)
class LoadFacts:
    """What the steps read, fixed once for the load.

    Attributes:
        dtype: Parameter dtype name.
        device: The rank's device kind.
        mesh: The group's FSDP mesh; None: one rank, nothing sharded.
        min_num_params: The size rule of the policy's last fallback.
        gather: ``"fsdp2"`` or ``"in_place"``.
        reshard_after_forward: Free a unit's gathered weights after its forward.
        forward_prefetch: Units gathered ahead.
        keep_gathered: Share of a diffusers model's units kept gathered (text encoders keep none).
        allow_pickle: Also read pickle checkpoints.
        cache_hooks: ``step_cache.enable``'s arguments, or None: no step cache.
        quantization: ``"none"`` or ``"fp8"`` (a diffusers model's unit linears).
        fused: Adapters merged into the weights as they load.
        pipeline_cls: The class the pipeline loads as (its LoRA loader reads the fused adapters).
        fp8_stored: Components whose FP8 linears the folder stores as they load (an FP8 folder:
            ``fp8_folder.stored_fp8_components``); their fused adapters are in those weights.
    """

    dtype: str
    device: str
    mesh: DeviceMesh | None
    min_num_params: int
    gather: str
    reshard_after_forward: bool
    forward_prefetch: int
    keep_gathered: float
    allow_pickle: bool
    cache_hooks: Mapping | None
    quantization: str
    fused: FusedLoras
    pipeline_cls: type
    fp8_stored: frozenset[str] = frozenset()


@dataclass
class LoadedParts:
    """What the steps made: the pipeline, each sharded component's sharding, load stats and
    policy, the token grid and the degree requests' tokens split over (``degree`` 1: no split;
    None: no sharded model gives a grid) and the components CFG parallel splits."""

    pipe: object
    shardings: dict
    stats: dict
    policies: dict
    sequence: dict | None
    cfg_split: tuple[str, ...]
    lane_parallel: LaneParallel | None = None
    compiled_modules: int = 0  # modules whose forward torch.compile compiled (each repeated block)


def fuse_adapters(pipeline_cls: type, module: nn.Module, component: str, fused: FusedLoras) -> None:
    """Merges into ``module`` (component ``component``, sharded or whole) the halves of the
    adapters in ``fused`` that name it, in ``fused``'s order (``adapters.fuse_loras``)."""
    from ray_hsdp.loading.adapters import fuse_loras
    from ray_hsdp.loading.lora_state import read_adapter

    named = [(name, scale, parts[component]) for name, (scale, parts) in fused.items() if component in parts]
    where = f"for {component} of {pipeline_cls.__name__}"
    adapters = [
        (read_adapter(pipeline_cls, path, f"fused lora {name!r} ({path}) {where}"), scale)
        for name, scale, path in named
    ]
    fuse_loras(module, adapters)
    for (name, scale, _), (adapter, _) in zip(named, adapters):
        logger.info("Fused lora %r into %d linears of %s at scale %s", name, len(adapter.targets), component, scale)


def keep_recorded_outputs(module: nn.Module) -> None:
    """transformers 5 looks up which outputs a model can record (``output_hidden_states``) by the
    name of its class, and sharding gives a sharded root a class of its own (``FSDPQwen2_5_VLTextModel``):
    without this a text encoder sharded at its root returns no hidden states (HunyuanVideo-1.5 reads
    its third-to-last). The registry is private to transformers; this is its own entry, under the new name."""
    recorded = getattr(module, "_can_record_outputs", None)
    if recorded is None:
        return
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    _CAN_RECORD_REGISTRY[module] = recorded


def shard_component(
    folder: Path, class_info: tuple[str, str], facts: LoadFacts, name: str, module: nn.Module | None = None
):
    """One sharded component, through its steps; ``module``: the component already built on the
    meta device (the start's checks build the diffusers models), else built here.

    Returns:
        ``(module, sharding, load stats)``.
    """
    module = module if module is not None else build_on_meta(folder, *class_info, facts.dtype)
    model_key = model_key_names(module)  # of the model's own classes: sharding renames them
    if facts.cache_hooks and hasattr(module, "enable_cache"):
        # Before fully_shard renames the block classes the hooks look for (the start's checks
        # refused a cache the model cannot run).
        step_cache.enable(module, **facts.cache_hooks)
    plan = resolve_plan(module, facts.min_num_params)
    denoiser = hasattr(module, "enable_parallelism")  # diffusers models, not text encoders
    fp8 = facts.quantization == "fp8" and denoiser
    stored = fp8 and name in facts.fp8_stored
    if fp8:
        fp8_linears(plan)
    sharding = shard_module(
        module,
        plan,
        facts.mesh,
        gather=facts.gather,
        reshard_after_forward=facts.reshard_after_forward,
        forward_prefetch=facts.forward_prefetch,
        # A text encoder runs once per request: its gathers are not worth the memory.
        keep_gathered=facts.keep_gathered if denoiser else 0.0,
    )
    keep_recorded_outputs(module)
    if stored:  # after sharding, which splits a unit by the dtypes it finds: as for a bfloat16 folder
        check_stored_linears(folder.parent, name, expect_stored_fp8(module))
    materialize(module, facts.device)
    stats = fill_from_checkpoint(module, folder, facts.allow_pickle, model_key)
    if facts.fused and not stored:  # before activate: the in-place gathers take over the shards there
        fuse_adapters(facts.pipeline_cls, module, name, facts.fused)
    if fp8:  # each rank its own rows, before the gathers take over the shards
        quantize_fp8(module)
    sharding.activate()
    return module, sharding, stats


def load_whole(folder: Path, module: nn.Module, facts: LoadFacts, name: str) -> dict:
    """A shard component on a rank that shards nothing, built on the meta device (``module``),
    materialised on the rank's device and filled there, through the pinned staging of the reads
    (diffusers' and transformers' loaders read into host memory, which the pipeline would then copy
    over, and cast an FP8 folder's weights); its fused adapters merged. An FP8 folder's linears
    (``facts.fp8_stored``) take their FP8 weights and scales as stored.

    Returns:
        The load stats.
    """
    model_key = model_key_names(module)
    stored = name in facts.fp8_stored
    if stored:
        fp8_linears(resolve_plan(module, facts.min_num_params))
        check_stored_linears(folder.parent, name, expect_stored_fp8(module))
    materialize(module, facts.device)
    stats = fill_from_checkpoint(module, folder, facts.allow_pickle, model_key)
    if stored:
        quantize_fp8(module, compile_scaling=False)  # each linear takes its loaded FP8 weight as it is
    elif facts.fused:  # an FP8 folder's were merged before it was quantized
        fuse_adapters(facts.pipeline_cls, module, name, facts.fused)
    return stats


def load_whole_components(
    path: Path, names: list[str], facts: LoadFacts, phases: Phases, meta_models: Mapping[str, nn.Module]
) -> tuple[dict, dict]:
    """``load_whole`` of each of ``names`` at once, in threads of their own (each reads with its own
    threads and copies on its own streams). The models are built on the meta device first, one
    after the other: accelerate's ``init_empty_weights`` patches ``nn.Module`` for every thread.

    Returns:
        ``(modules, load stats)`` by name.
    """
    index = model_index(path)
    modules = {
        name: meta_models[name] if name in meta_models else build_on_meta(path / name, *index[name], facts.dtype)
        for name in names
    }

    def load(name: str) -> dict:
        with phases.phase(f"weights of {name}"):
            return load_whole(path / name, modules[name], facts, name)

    with ThreadPoolExecutor(max(1, len(names)), thread_name_prefix="ray_hsdp-component") as pool:
        stats = dict(zip(names, pool.map(load, names)))
    return modules, stats


def quantize_unsharded(models: Mapping[str, nn.Module], min_num_params: int, phases: Phases) -> int:
    """FP8 linears on a rank that shards nothing (a group of one rank): in each diffusers model of
    the shard components, the linears its policy's units hold, each quantized whole, row by row:
    the very weights the ranks of a sharded group quantize in slices and gather. Each model moves
    to ``device`` first (the pipeline loads on the CPU): quantized there, its linears scale their
    inputs with the fused kernel (``fp8.fused_scale_rows``), which a CPU tensor would not pick.

    Returns:
        How many linears became FP8.
    """
    swapped = 0
    for name, module in models.items():
        with phases.phase(f"fp8 of {name}"):
            swapped += fp8_linears(resolve_plan(module, min_num_params))
            quantize_fp8(module, compile_scaling=False)
        with phases.phase("fp8 scaling compile"):
            compile_fp8_scaling(module)
    return swapped


def token_grid(pipe, module, policy, degree: int) -> dict:
    """The facts a request's tokens are counted by (``variant.lane.sequence_tokens``) and the
    degree they must split over."""
    temporal_stride, temporal_patch, spatial_stride = policy.token_grid(pipe, module)
    return {
        "degree": degree,
        "temporal_stride": temporal_stride,
        "temporal_patch": temporal_patch,
        "spatial_stride": spatial_stride,
    }


def split_sequences(
    pipe, models: dict, policies: dict, dims: ParallelDims, lane_mesh, device: str, backend, lane_meshes: dict
):
    """Enables context parallel on every (sharded) diffusers model of the pipeline: over the fixed
    lanes' sub-mesh, or for adaptive lanes over the widest lane's, switched per forward.

    Returns:
        The facts callers check request sizes with (the degree and the token grid), and with
        adaptive lanes what switches the models to a forward's lane (else ``None``).

    Raises:
        ValueError: No model can be split, or one's policy gives no token grid.
    """
    if not models:
        raise ValueError(
            f"ulysses_degree x ring_degree = {dims.sequence_degree}, but no sharded component of "
            f"{type(pipe).__name__} is a diffusers model that context parallel can split"
        )
    sequence, configs = None, []
    widest = max(lane_meshes, key=lambda size: lane_meshes[size]["ulysses"].size(), default=0)
    for name, module in models.items():
        policy = policies.get(name)
        config = enable_context_parallel(
            module,
            lane_meshes[widest] if dims.adaptive else lane_mesh,
            ring=dims.ring,
            ulysses=lane_meshes[widest]["ulysses"].size() if dims.adaptive else dims.ulysses,
            device=device,
            attention_backend=backend,
            cp_plan=policy.cp_plan if policy else None,
        )
        configs.append(config)
        if policy is not None and policy.split_inputs is not None:
            # The config's degree is the running lane's (adaptive lanes set it per forward).
            module.register_forward_pre_hook(
                lambda _, args, kwargs, split=policy.split_inputs, config=config: (
                    args,
                    split(kwargs, config._world_size),
                ),
                with_kwargs=True,
            )
        if policy is None or policy.token_grid is None:
            raise ValueError(
                f"{name} ({type(module).__name__.removeprefix('FSDP')}) has no token grid in its sharding policy, "
                "so request sizes cannot be checked against ulysses_degree x ring_degree"
            )
        sequence = token_grid(pipe, module, policy, dims.sequence_degree)  # adaptive: 1 (each lane splits it)
    if not dims.adaptive:
        return sequence, None
    return sequence, LaneParallel(list(zip(models.values(), configs)), lane_meshes)


def cfg_split_of(dims: ParallelDims, shardings: dict, policies: dict) -> tuple[str, ...]:
    """The sharded components whose policies say the pipeline calls them for the conditional, then
    the unconditional prediction; none without CFG parallel (the start's checks refused CFG
    parallel where none does: ``start_checks.refuse_cfg_split``)."""
    if dims.cfg != 2:
        return ()
    return tuple(name for name in shardings if policies[name] is not None and policies[name].cfg_split)


def compile_models(models: dict[str, nn.Module], shardings: dict) -> int:
    """Compiles the blocks of each diffusers model: a sharded one's units, an unsharded one's
    repeated blocks (``sharding.apply``), after its policy's ``traceable`` step. Returns how many."""
    compiled = 0
    for name, module in models.items():
        policy = registered_policy(module)
        if policy is not None and policy.traceable is not None:
            policy.traceable()
        if name in shardings:
            compiled += compile_units(shardings[name])
        else:  # a group of one rank: the blocks diffusers' regional compile would pick
            compiled += compile_repeated_blocks(module)
    return compiled


def load_parts(
    path: Path,
    facts: LoadFacts,
    shard_components: tuple[str, ...],
    *,
    dims: ParallelDims,
    lane_mesh: DeviceMesh | None,
    backend: str | None,
    compile: bool,
    phases: Phases,
    lane_meshes: dict | None = None,
    meta_models: dict[str, nn.Module] | None = None,
) -> LoadedParts:
    """The load, step by step: the sharded components (none without a mesh: one rank; those in
    ``meta_models`` as the start's checks built them on the meta device), the others, the
    attention backend or context parallel, compile, the CFG split.

    Raises:
        ValueError: None of ``shard_components`` is a component of the pipeline, or the lanes ask
            for a split (sequence, CFG) that no component supports.
    """
    prebuilt, shardings, stats, policies = {}, {}, {}, {}
    if facts.mesh is not None:
        index = model_index(path)
        for name in (n for n in shard_components if n in index):
            with phases.phase(f"shards of {name}"):
                prebuilt[name], shardings[name], stats[name] = shard_component(
                    path / name, index[name], facts, name, (meta_models or {}).get(name)
                )
            policies[name] = registered_policy(prebuilt[name])
        if not shardings:
            raise ValueError(
                f"None of shard_components={list(shard_components)} is a component of this pipeline "
                f"(its components: {sorted(index)}); nothing would be sharded"
            )
    else:
        index = model_index(path)
        names = [n for n in shard_components if n in index]
        with phases.phase("weights of shard components"):
            prebuilt, stats = load_whole_components(path, names, facts, phases, meta_models or {})
        for name in sorted(facts.fp8_stored):
            with phases.phase("fp8 scaling compile"):
                compile_fp8_scaling(prebuilt[name])
    fused = facts.fused
    with phases.phase("other components"):
        pipe = load_pipeline(path, facts.dtype, facts.allow_pickle, facts.pipeline_cls, **prebuilt)
        for component in sorted({c for _, parts in fused.values() for c in parts} - set(prebuilt)):
            module = getattr(pipe, component, None)
            if not isinstance(module, nn.Module):
                raise ValueError(f"fuse_loras: {type(pipe).__name__} has no component {component!r}")
            fuse_adapters(facts.pipeline_cls, module, component, fused)
    # Only diffusers models have attention backends, context parallel and repeated blocks.
    candidates = {name: getattr(pipe, name, None) for name in shard_components}
    models = {name: m for name, m in candidates.items() if hasattr(m, "enable_parallelism")}
    if facts.quantization == "fp8" and facts.mesh is None:  # after the fused adapters, which it quantizes
        to_quantize = {name: m for name, m in models.items() if name not in facts.fp8_stored}
        quantize_unsharded(to_quantize, facts.min_num_params, phases)
    sequence = lane_parallel = None
    with phases.phase("parallel setup"):
        if dims.splits_sequence:
            sequence, lane_parallel = split_sequences(
                pipe, models, policies, dims, lane_mesh, facts.device, backend, lane_meshes or {}
            )
        else:
            if backend is not None:
                for module in models.values():
                    set_attention_backend(module, backend)
            # No split, but the group still counts a request's work by its tokens (group.lanes.LaneTimes).
            gridded = [(m, policies[n]) for n, m in models.items() if getattr(policies.get(n), "token_grid", None)]
            sequence = token_grid(pipe, *gridded[0], degree=1) if gridded else None
        compiled = compile_models(models, shardings) if compile else 0
    split = cfg_split_of(dims, shardings, policies)
    return LoadedParts(pipe, shardings, stats, policies, sequence, split, lane_parallel, compiled)
