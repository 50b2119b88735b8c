"""Context parallel (Ulysses, ring) on an FSDP-sharded transformer, through diffusers.

diffusers splits the sequence at the points its ``_cp_plan`` names and replaces each attention
with an all-to-all (Ulysses) or a K/V ring over the lane's ``ring`` x ``ulysses`` sub-mesh; FSDP2
keeps gathering the weights over the whole group. Nothing here reimplements either.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
from diffusers import ContextParallelConfig
from torch.distributed.device_mesh import DeviceMesh

from ray_hsdp.config.kernels import (  # noqa: F401 (read here by callers that set backends)
    CPU_BACKENDS,
    CROSS_ATTENTION_NATIVE,
    PER_CHANNEL_V_BACKENDS,
    PROJECT_BACKENDS,
    RING_BACKENDS,
)
from ray_hsdp.config.pairs import refuse_model
from ray_hsdp.sharding import attention_ops, fa3_fp8


def attention_backend_for(requested: str, device: str, ring: int) -> str | None:
    """The attention backend a transformer gets: ``requested``, or for ``"auto"`` diffusers' own
    default (``None``), except ``_native_cudnn`` on CUDA when ring attention needs the log-sum-exp.

    Raises:
        ValueError: A backend that needs CUDA on CPU ranks.
    """
    if requested == "auto":
        return RING_BACKENDS[0] if ring > 1 and device == "cuda" else None
    if device == "cpu" and requested not in CPU_BACKENDS:
        raise ValueError(f"attention_backend={requested!r} needs CUDA; on CPU ranks use one of {list(CPU_BACKENDS)}")
    return requested


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """diffusers' ``set_attention_backend`` on ``model`` (``fa3_fp8`` and ``sage`` registered with
    diffusers first, around their kernels' custom ops: ``sharding.attention_ops``), except that under a
    backend of ``CROSS_ATTENTION_NATIVE`` its cross-attentions keep torch's SDPA: their keys (a text
    of a few hundred tokens) may hold a channel that is zero at every key, and they are a small share
    of the attention time, which the self-attentions over the video's tokens take."""
    installers = {fa3_fp8.NAME: fa3_fp8.install, attention_ops.SAGE: attention_ops.install_sage}
    model.set_attention_backend(installers[backend]() if backend in installers else backend)
    if backend in CROSS_ATTENTION_NATIVE:
        keep_cross_attention_native(model)


def keep_cross_attention_native(model: nn.Module) -> int:
    """Sets every cross-attention of ``model`` (a diffusers attention module whose
    ``is_cross_attention`` is true) to diffusers' ``native`` backend; returns how many."""
    kept = 0
    for module in model.modules():
        if getattr(module, "is_cross_attention", False) and hasattr(module, "set_attention_backend"):
            module.set_attention_backend("native")
            kept += 1
    return kept


@contextmanager
def _one_device_per_rank(device: str):
    """diffusers 0.42.1's ``enable_parallelism`` picks the rank's device as ``rank %
    torch.accelerator.device_count()``, which divides by zero on a host without accelerators.
    A rank here owns exactly one device (``cuda:0`` inside its Ray actor, or the CPU), so the
    count it should see is 1; on CUDA it is 1 already and nothing changes."""
    if device != "cpu":
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def refuse_split(module: nn.Module, cp_plan: dict | None) -> None:
    """Refuses lanes that split the sequence of ``module`` (a diffusers model) when neither it
    (``_cp_plan``) nor its policy (``cp_plan``) says how to split it (a model row of ``ray_hsdp.config.pairs``).

    Raises:
        ValueError: Its message names the model, the lanes, why, and what to do instead.
    """
    name = type(module).__name__.removeprefix("FSDP")
    plan = cp_plan is not None or getattr(module, "_cp_plan", None) is not None
    refuse_model({"model": name, "splits_sequence": True, "context_parallel_plan": plan})


def refuse_heads(module: nn.Module, ulysses: int) -> None:
    """Refuses a Ulysses degree that does not divide ``module``'s attention heads.

    Raises:
        ValueError: Naming the degree, the heads and the model.
    """
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if heads is not None and heads % ulysses:
        name = type(module).__name__.removeprefix("FSDP")
        raise ValueError(f"ulysses_degree={ulysses} does not divide the {heads} attention heads of {name}")


def refuse_lane_heads(module: nn.Module, ulysses_by_lane: dict[int, int]) -> None:
    """Refuses adaptive lanes whose Ulysses split (lane size -> its Ulysses ranks) divides
    ``module``'s attention heads unevenly.

    Raises:
        ValueError: Naming the lane size and the heads.
    """
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    bad = [size for size, ulysses in sorted(ulysses_by_lane.items()) if heads is not None and heads % ulysses]
    if bad:
        raise ValueError(
            f"lane_sizes: a lane of {bad[0]} ranks splits the {heads} attention heads unevenly "
            "(with cfg_parallel a lane splits them over half its ranks)"
        )


def enable_context_parallel(
    module: nn.Module,
    lane_mesh: DeviceMesh,
    *,
    ring: int,
    ulysses: int,
    device: str,
    attention_backend: str | None,
    cp_plan: dict | None = None,
) -> ContextParallelConfig:
    """Splits every forward of ``module`` over its lane's ``ring`` x ``ulysses`` ranks; returns
    the config its hooks read.

    Call it on every rank of the group in the same order (diffusers flattens the sub-mesh, which
    creates process groups).

    Args:
        module: A diffusers model, FSDP-sharded already.
        lane_mesh: The group's ``("lane", "cfg", "ring", "ulysses")`` mesh.
        ring: Ring degree.
        ulysses: Ulysses degree.
        device: ``"cuda"`` or ``"cpu"``.
        attention_backend: diffusers backend name, or ``None`` for diffusers' default.
        cp_plan: The policy's plan for a model class without ``_cp_plan``.

    Raises:
        ValueError: The degrees do not fit the model (heads), the attention backend cannot run
            ring attention, or the model has no context-parallel plan; each names the setting.
    """
    refuse_split(module, cp_plan)
    refuse_heads(module, ulysses)
    if ring > 1 and attention_backend not in RING_BACKENDS:
        raise ValueError(
            f"ring_degree={ring} needs an attention backend that returns the log-sum-exp "
            f"({', '.join(RING_BACKENDS)}; CUDA and bf16/fp16 only); attention_backend is "
            f"{attention_backend or 'diffusers default (native)'} on {device}"
        )
    if attention_backend is not None:
        set_attention_backend(module, attention_backend)
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=lane_mesh)
    with _one_device_per_rank(device):
        module.enable_parallelism(config=config, cp_plan=cp_plan)
    return config


class LaneParallel:
    """Switches the context parallel of a rank's models to the lane of the forward about to run,
    for a group of adaptive lanes (``lane_sizes``): Ulysses over the lane's Ulysses ranks, or none
    on a lane without a Ulysses split (one rank, or two CFG halves of one rank each).

    diffusers binds a model's split hooks and attention processors to one ``ContextParallelConfig``
    and refuses a second ``enable_parallelism``; each model here is enabled once on the widest
    lane's mesh, and the config's mesh state (what diffusers' ``setup`` records on it) is set to
    the running lane's before each forward, on the tick thread (one forward at a time). Every
    mesh is built at start, on every rank, so no forward creates a process group.

    On a lane without a Ulysses split the attention processors get no parallel config (diffusers'
    backends run plain attention only then), and the split hooks split over a mesh of one rank:
    nothing.

    Args:
        models: The models ``enable_context_parallel`` enabled, with the configs it returned.
        meshes: Lane size -> the group's mesh of lanes of that size, dims ``LANE_MESH_DIM_NAMES``.
    """

    def __init__(self, models: list[tuple[nn.Module, ContextParallelConfig]], meshes: dict[int, DeviceMesh]):
        for module, _ in models:
            refuse_lane_heads(module, {size: mesh["ulysses"].size() for size, mesh in meshes.items()})
        self.configs = [config for _, config in models]
        # (processor, the parallel config diffusers gave it): switched off on lanes without a split.
        self.processors = [
            (sub.processor, sub.processor._parallel_config)
            for module, _ in models
            for sub in module.modules()
            if getattr(getattr(sub, "processor", None), "_parallel_config", None) is not None
        ]
        self.states = {size: self._state(size, mesh) for size, mesh in meshes.items()}
        self.active: int | None = None

    @staticmethod
    def _state(size: int, mesh: DeviceMesh) -> dict:
        ulysses = mesh["ulysses"]  # with ring 1 the flattened (ring, ulysses) mesh is this one
        return {
            "ring_degree": 1,
            "ulysses_degree": ulysses.size(),
            "_world_size": ulysses.size(),  # diffusers' attention splits only when this is above 1
            "_mesh": mesh,
            "_flattened_mesh": ulysses,
            "_ring_mesh": mesh["ring"],
            "_ulysses_mesh": ulysses,
            "_ring_local_rank": 0,
            "_ulysses_local_rank": ulysses.get_local_rank(),
        }

    def sequence_groups(self, size: int) -> list:
        """The process groups a lane of ``size`` ranks splits a request's tokens over (First Block
        Cache reduces its measure over them); none without a Ulysses split."""
        ulysses = self.states[size]["_ulysses_mesh"]
        return [ulysses.get_group()] if ulysses.size() > 1 else []

    def activate(self, size: int) -> None:
        """Sets every model's context parallel to a lane of ``size`` ranks (this rank's)."""
        if size == self.active:
            return
        for config in self.configs:
            vars(config).update(self.states[size])
        split = self.states[size]["ulysses_degree"] > 1
        for processor, parallel in self.processors:
            processor._parallel_config = parallel if split else None
        self.active = size
