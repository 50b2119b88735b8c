"""A diffusers pipeline whose large components are sharded over the group's mesh."""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.loading.fp8_folder import stored_fp8_components
from ray_hsdp.loading.staged_reads import release_pinned_memory
from ray_hsdp.loading.start_checks import refuse_start, start_facts
from ray_hsdp.loading.steps import LoadFacts, load_parts
from ray_hsdp.memory import module_memory, peak_device_bytes, unit_memory
from ray_hsdp.phases import Phases
from ray_hsdp.pipeline.args import call_kwargs, call_takes, guidance_on, step_end_callback, steps_watched
from ray_hsdp.pipeline.frames import to_host
from ray_hsdp.pipeline.load_options import LoadOptions
from ray_hsdp.pipeline.request_slots import RequestSlots, SlotDecodes
from ray_hsdp.request import (
    GenerationResult,
    NonFiniteOutputError,
)
from ray_hsdp.sharding.context_parallel import attention_backend_for
from ray_hsdp.sharding.fp8 import check_fp8_device
from ray_hsdp.sharding.pipeline_call import FIRST_FRAME, REFERENCE, pipeline_call_for
from ray_hsdp.variant import RankFeatures, RequestVariant
from ray_hsdp.variant.shift import shift_key

logger = logging.getLogger("ray_hsdp")


def steps_reaching_every_expert(pipe, most: int = 16) -> int:
    """The fewest denoising steps whose timesteps reach every expert of a pipeline that switches
    experts at a boundary (diffusers' ``boundary_ratio``: the first expert at timesteps at or above
    ``boundary_ratio x num_train_timesteps``, the second below), at most ``most``; 1 for a pipeline
    of one denoiser. A warm-up request of that many steps runs each expert's first forwards (its
    compile, its first gathers) before a user's request would: a 1-step warm-up reaches the first
    expert alone."""
    ratio = getattr(pipe.config, "boundary_ratio", None)
    scheduler = getattr(pipe, "scheduler", None)
    if ratio is None or scheduler is None:
        return 1
    boundary = ratio * scheduler.config.num_train_timesteps
    probe = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler; the pipeline's stays as it is
    for steps in range(1, most + 1):
        probe.set_timesteps(steps)
        if bool((probe.timesteps >= boundary).any()) and bool((probe.timesteps < boundary).any()):
            return steps
    return most


def call_facts(pipe) -> dict:
    """What callers must know of a pipeline's call: whether it makes videos, by how much its VAE
    compresses time (a video VAE that compresses ``t`` times takes ``t * k + 1`` frames), the
    choices it takes. Read from its class, configs and scheduler alone: a pipeline whose weights are
    not loaded (``start_checks.pipeline_on_meta``) gives the same facts."""
    params = set(inspect.signature(pipe.__call__).parameters)
    call = pipeline_call_for(pipe)
    scheduler = getattr(pipe, "scheduler", None)
    min_steps = 2 if getattr(getattr(scheduler, "config", None), "shift_terminal", None) else 1
    return {
        "video": "num_frames" in params,
        "temporal_compression": int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1),
        # Two experts with a boundary: the low-noise one takes its own guidance.
        "guidance_scale_2": "guidance_scale_2" in params and getattr(pipe.config, "boundary_ratio", None) is not None,
        # Image-to-video: every request brings its first frame; or an optional reference image.
        "image_input": "image" in params and call.image == FIRST_FRAME,
        "image_reference": "image" in params and call.image == REFERENCE,
        # Request choices the pipeline may not take (diffusers would ignore them unread): a
        # negative prompt, a size (none where its output follows its input image).
        **call_takes(params),
        "lora": hasattr(pipe, "load_lora_weights"),
        # The scheduler key a request's flow_shift sets; None: the scheduler takes no shift.
        "flow_shift": shift_key(scheduler),
        # A request's sigmas need diffusers' flow-match Euler (its own, or sample_solver euler).
        "euler": type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler",
        # The fewest steps its scheduler takes: one that stretches its schedule to a terminal
        # shift (Qwen-Image's) divides by zero at one step, and every frame comes out NaN.
        "min_steps": min_steps,
        # Steps of a warm-up request that reaches every expert (one for one denoiser).
        "warm_up_steps": max(steps_reaching_every_expert(pipe), min_steps),
    }


def components(pipe) -> dict[str, nn.Module]:
    """The ``nn.Module`` components of a diffusers pipeline, by name."""
    return {name: c for name, c in pipe.components.items() if isinstance(c, nn.Module)}


def _part_attribute(part: str, name: str, doc: str) -> property:
    """A pipeline attribute that its part ``part`` holds as ``name`` (read and set through the
    pipeline, as before the part was one)."""
    return property(
        lambda self: getattr(getattr(self, part), name),
        lambda self, value: setattr(getattr(self, part), name, value),
        doc=doc,
    )


class ShardedPipeline:
    """Owns one rank's copy of a pipeline: its sharded and replicated components, its request
    slots (``slots``, ``RequestSlots``) and how each slot decodes (``decodes``, ``SlotDecodes``).

    Args:
        pipe: A loaded diffusers pipeline; sharded components already on ``device``.
        device: ``"cuda"`` or ``"cpu"``.
        rank: This rank's index in its group.
        shardings: Component name -> how it is sharded (``FsdpUnits`` or ``InPlaceUnits``), for
            the components that are.
        load_stats: What loading read, per sharded component.
    """

    request_streams = _part_attribute("slots", "streams", "Whether each request slot has a CUDA stream of its own.")
    vae_tiling = _part_attribute("decodes", "tiling", "``(mode, pixels)``: when a decode uses the VAE's tiling.")
    vae_parallel = _part_attribute("decodes", "parallel", "When a lane shares a request's decode.")
    lane_tiles = _part_attribute("decodes", "lane_tiles", "Lane size -> this rank's side of its split decodes.")

    def __init__(
        self,
        pipe,
        device: str,
        rank: int,
        shardings: dict | None = None,
        load_stats=None,
        sequence: dict | None = None,
        cfg_split: tuple[str, ...] = (),
    ):
        self.pipe = pipe
        self.device = device
        self.rank = rank
        self.shardings = dict(shardings or {})
        #: Component name -> number of units below its root, for the sharded components.
        self.sharded = {name: len(s.unit_modules) - 1 for name, s in self.shardings.items()}
        self.load_stats = dict(load_stats or {})
        #: How requests' tokens are counted (the token grid) and split (``degree``; 1: not split).
        self.sequence = sequence
        #: Components whose cond / uncond calls of a step run on the two CFG halves of a lane.
        self.cfg_split = cfg_split
        self.compiled_modules = 0  # modules whose forward is compiled (``load``)
        self._running_slot = threading.local()
        #: What the rank loaded for per-request features (adapters, step caches), which each
        #: request's variant applies its choices to.
        self.features = RankFeatures()
        self._call_params = set(inspect.signature(pipe.__call__).parameters)
        #: How the pipeline's class takes a request's choices (guidance, negative prompt, image).
        self.call = pipeline_call_for(pipe)
        pipe.set_progress_bar_config(disable=True)
        self.modules = components(pipe)  # the real modules, also once proxies stand in for sharded ones
        for name, module in self.modules.items():
            if name not in self.sharded:
                module.to(device)
        self.slots = RequestSlots(pipe, self.modules, device)
        self.decodes = SlotDecodes(pipe, rank)

    @classmethod
    def load(cls, path, options: LoadOptions) -> ShardedPipeline:
        """Loads a pipeline folder as ``options`` say, sharding the named components over its
        mesh, by the steps of ``ray_hsdp.loading.steps``, after the start's checks
        (``ray_hsdp.loading.start_checks``): a sharded component built on the meta device, sharded,
        materialised on the device, filled with this rank's slices only (nothing sharded without a
        mesh). Lanes that split the sequence split a model's forwards over the lane's ``ring`` x
        ``ulysses`` sub-mesh of ``lane_mesh``, or over its request's lane (``lane_meshes``).

        Raises:
            ValueError: A start check's refusal, or none of ``shard_components`` is a module of it.
        """
        dims = options.dims or ParallelDims(1, 1)
        phases = options.phases or Phases("pipeline")
        if options.quantization == "fp8":
            check_fp8_device(options.device)
        with phases.phase("start checks"):  # what ray-hsdp check runs too, before any weight loads
            start = start_facts(Path(path), options.pipeline, options.shard_components, options.dtype)
            cache_kind = options.cache_hooks["kind"] if options.cache_hooks else "none"
            refuse_start(
                start,
                dims,
                options.attention_backend,
                cache_kind,
                options.sample_solver,
                dict(options.scheduler_config or {}),
            )
        fused = dict(options.fuse_loras or {})
        # An FP8 folder (ray-hsdp quantize) gives its linears as stored, to the configuration it was made with.
        scales = {name: scale for name, (scale, _) in fused.items()}
        fp8_stored = stored_fp8_components(
            Path(path), options.quantization, options.dtype, options.min_num_params, scales, torch.__version__,
            options.shard_components, {name: parts for name, (_, parts) in fused.items()},
        )  # fmt: skip
        facts = LoadFacts(
            dtype=options.dtype, device=options.device, mesh=options.mesh, min_num_params=options.min_num_params,
            gather=options.gather, reshard_after_forward=options.reshard_after_forward,
            forward_prefetch=options.forward_prefetch, keep_gathered=options.keep_gathered,
            allow_pickle=options.allow_pickle, cache_hooks=options.cache_hooks, quantization=options.quantization,
            fused=fused, pipeline_cls=start.pipeline_cls, fp8_stored=fp8_stored,
        )  # fmt: skip
        backend = attention_backend_for(options.attention_backend, options.device, dims.ring)
        parts = load_parts(
            path, facts, options.shard_components, dims=dims, lane_mesh=options.lane_mesh, backend=backend,
            compile=options.compile, phases=phases, lane_meshes=options.lane_meshes, meta_models=start.models,
        )  # fmt: skip
        if options.scheduler_config:
            scheduler = parts.pipe.scheduler
            parts.pipe.scheduler = type(scheduler).from_config(scheduler.config, **options.scheduler_config)
        release_pinned_memory()  # the reads' staging buffers, cached by torch's host allocator
        with phases.phase("replicated components to device"):
            pipeline = cls(
                parts.pipe, options.device, options.rank, parts.shardings, parts.stats, parts.sequence, parts.cfg_split
            )
        # Its models switched per forward to its request's lane (adaptive lanes).
        pipeline.features.lane_parallel = parts.lane_parallel
        pipeline.compiled_modules = parts.compiled_modules
        return pipeline

    @property
    def facts(self) -> dict:
        """What callers must know of this pipeline (``call_facts``), and how its lanes split it."""
        return {**call_facts(self.pipe), "sequence": self.sequence, "cfg_split": list(self.cfg_split)}

    def guided(self) -> bool:
        """Whether the request running on this thread makes an unconditional forward at each step
        (diffusers' ``do_classifier_free_guidance`` of its slot pipeline)."""
        pipe = getattr(self._running_slot, "pipe", None)
        return pipe is not None and self.call.guided(pipe, self._running_slot.kwargs)

    @property
    def sharded_modules(self) -> dict[str, nn.Module]:
        """Name -> the real module, for the sharded components."""
        return {name: self.modules[name] for name in self.sharded}

    def route_calls(self, stand_ins: dict[str, object]) -> None:
        """Makes the pipeline call ``stand_ins`` instead of its sharded modules (the runtime's
        proxies, which run every forward at a tick of the rank's tick thread)."""
        for name, stand_in in stand_ins.items():
            # Plain attribute: DiffusionPipeline.__setattr__ would register the proxy in its config.
            object.__setattr__(self.pipe, name, stand_in)

    @torch.no_grad()
    def run(self, variant: RequestVariant, on_step: Callable[[int, int], bool] | None = None) -> GenerationResult:
        """Runs one request through the pipeline, inside its variant (``RequestVariant.run``).

        Args:
            variant: The request and its choices (``RequestVariant.unchecked(request)`` for a
                request run without a group).
            on_step: Called with (steps done, steps in all) after each denoising step; when it
                returns True the request stops there, without decoding.

        Raises:
            RequestCancelledError: ``on_step`` asked to stop. Raised from the step callback rather
                than through diffusers' interrupt flag, which still decodes every frame (in Wan).
        """
        request = variant.request
        kwargs = call_kwargs(self.call, self._call_params, type(self.pipe).__name__, variant)
        step_ends: list[float] = []
        step_ended = step_end_callback(request, on_step, step_ends) if on_step is not None else None
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        pipe = self.slots.take()
        self._running_slot.pipe, self._running_slot.kwargs = pipe, kwargs
        try:
            self.decodes.set_tiling(pipe, variant)
            with (
                variant.run(pipe, self.features),
                guidance_on(pipe, self.call, request.guidance_scale),
                steps_watched(pipe, self._call_params, kwargs, step_ended),
                torch.cuda.stream(self.slots.stream(pipe)),
            ):
                output = pipe(**kwargs)
                host = to_host(output.frames if hasattr(output, "frames") else output.images, request.uint8_frames)
        finally:
            self._running_slot.pipe = None
            self.slots.give_back(pipe)
            released = variant.release(self.features)
        if host.non_finite:  # NaN survives diffusers' clamp to [0, 1]
            raise NonFiniteOutputError(
                f"request {request.request_id!r}: the model made {host.non_finite} NaN or infinite values of "
                f"{host.frames.size} in its frames (a numeric fault of the model or its kernels, e.g. its quantization "
                "or attention backend; not of the request)"
            )
        end = time.perf_counter()
        step_s = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) if len(step_ends) > 1 else None
        return GenerationResult(
            frames=host.frames,
            seed=request.seed,
            rank=self.rank,
            elapsed_s=end - start,
            request_id=request.request_id,
            peak_device_bytes=peak_device_bytes(self.device),
            step_s=step_s,
            before_loop_s=max(0.0, step_ends[0] - start - step_s) if step_s is not None else None,
            after_loop_s=end - step_ends[-1] if step_ends else None,
            cached_forwards=released.get("cached_forwards"),
        )

    def memory(self, units: bool = False) -> dict:
        """Bytes held on this rank, per component and in total.

        Args:
            units: Also report each unit's local and full bytes.
        """
        per_component = {name: module_memory(m) for name, m in self.modules.items()}
        total = {key: sum(c[key] for c in per_component.values()) for key in next(iter(per_component.values()))}
        total["replicated"] += self.slots.copy_bytes  # the other request slots' own VAE, tokenizers...
        # In-place gathers hold their buffers at all times (FSDP2 allocates per forward: 0 here).
        total["gather_buffers"] = sum(s.buffer_bytes for s in self.shardings.values())
        # Units kept gathered: whole weights in buffers of their own, which the modules hold as plain
        # tensors (counted once, here, not also as replicated).
        total["kept_whole"] = sum(s.kept_bytes for s in self.shardings.values())
        total["replicated"] -= total["kept_whole"]
        out = {
            "components": per_component,
            "total": total,
            "sharded_components": dict(self.sharded),
            "request_slots": self.slots.count,
        }
        if units:
            out["units"] = {name: unit_memory(s.unit_modules) for name, s in self.shardings.items()}
        return out

    @property
    def request_slots(self) -> int:
        """How many requests this rank runs at the same time (``set_request_slots``)."""
        return self.slots.count

    @property
    def slot_copies(self) -> list:
        """The other slots' pipelines (the first slot is ``pipe``): their own VAE, scheduler, tokenizers."""
        return self.slots.copies

    @property
    def slot_copy_bytes(self) -> int:
        """The bytes of the other slots' own modules."""
        return self.slots.copy_bytes

    def set_request_slots(self, slots: int, shared: tuple[str, ...]) -> None:
        """Prepares ``slots`` pipelines that run requests at the same time on this rank, sharing the
        modules named in ``shared`` (``RequestSlots.fill``)."""
        self.slots.fill(slots, shared)

    def splits_decode(self, variant: RequestVariant) -> bool:
        """Whether the ranks of this rank's lane share the decode of ``variant``'s request
        (``decode_share``); the same answer on every rank of the lane."""
        return self.decodes.share(variant) is not None

    def decode_share(self, variant: RequestVariant) -> str | None:
        """How the ranks of this rank's lane share the decode of ``variant``'s request
        (``SlotDecodes.share``): ``"rows"``, ``"tiles"``, or ``None``: the leader decodes alone."""
        return self.decodes.share(variant)

    def vae_channels_last(self) -> int:
        """Puts the VAE's 3D convolution weights in channels-last memory (``torch.channels_last_3d``);
        call before ``set_request_slots``, whose copies keep the format. Returns how many."""
        vae = getattr(self.pipe, "vae", None)
        if not isinstance(vae, torch.nn.Module):
            return 0
        torch.nn.utils.convert_conv3d_weight_memory_format(vae, torch.channels_last_3d)
        return sum(isinstance(m, torch.nn.Conv3d) for m in vae.modules())
