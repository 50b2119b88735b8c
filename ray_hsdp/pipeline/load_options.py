"""How ``ShardedPipeline.load`` loads a pipeline folder: one object, built by a rank's start from
its configuration and meshes, or by a test or a benchmark with the few it sets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types alone: a caller that only builds the options imports no torch
    from torch.distributed.device_mesh import DeviceMesh

    from ray_hsdp.config.topology import ParallelDims
    from ray_hsdp.loading.steps import FusedLoras
    from ray_hsdp.phases import Phases


@dataclass(frozen=True)
class LoadOptions:
    """What ``ShardedPipeline.load`` reads besides the folder, fixed for one load."""

    #: Parameter dtype name (``"bfloat16"``, ``"float32"``).
    dtype: str
    #: ``"cuda"`` or ``"cpu"``.
    device: str
    #: This rank's index in its group.
    rank: int
    #: The group's FSDP mesh; ``None``: one rank, nothing sharded.
    mesh: DeviceMesh | None
    #: The components to shard (those the folder has).
    shard_components: tuple[str, ...]
    #: The size rule of the sharding policy's last fallback.
    min_num_params: int
    #: Free a unit's gathered weights after its forward.
    reshard_after_forward: bool
    #: Units gathered ahead of the one running.
    forward_prefetch: int
    #: Share of a diffusers model's units kept gathered (whole) from the load on.
    keep_gathered: float = 0.0
    #: How units gather: ``"fsdp2"`` or ``"in_place"``.
    gather: str = "fsdp2"
    #: Also read pickle checkpoints.
    allow_pickle: bool = False
    #: The pool's mesh arithmetic (``None``: one lane of one rank).
    dims: ParallelDims | None = None
    #: The mesh whose ``ring`` x ``ulysses`` sub-mesh a lane that splits the sequence runs on.
    lane_mesh: DeviceMesh | None = None
    #: Lane size -> mesh, for adaptive lanes (a request's lane picks its forwards' split).
    lane_meshes: Mapping | None = None
    #: The attention backend asked for (``"auto"``: the best this device runs).
    attention_backend: str = "auto"
    #: Compile the models' repeated blocks.
    compile: bool = False
    #: Adapters merged into the weights as the rows load: name -> (scale, component -> path).
    fuse_loras: FusedLoras | None = None
    #: ``step_cache.enable``'s arguments, which put a step cache's hooks on; ``None``: no step cache.
    cache_hooks: Mapping | None = None
    #: ``"none"`` or ``"fp8"`` (the units' linears kept in FP8).
    quantization: str = "none"
    #: Where the load's time goes (``None``: a record of its own).
    phases: Phases | None = None
    #: The class to load the folder as (``None``: the one the folder names).
    pipeline: str | None = None
    #: The group's default solver (refused for a scheduler without a static shift).
    sample_solver: str | None = None
    #: Settings that replace those of the folder's scheduler.
    scheduler_config: Mapping | None = None
