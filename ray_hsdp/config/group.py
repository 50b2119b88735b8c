"""Typed, validated configuration of one shard group: the model it serves, its layout, its queue,
its kernels and the request features it allows (``GroupConfig``).

Every field carries a description and the default a user would pick. Validation errors name the
field and the rule, the way vllm-omni's ``--use-hsdp`` flags report them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_hsdp.config.blocks import StepCacheConfig
from ray_hsdp.config.embedded import EMBEDDED_LORAS, EMBEDDED_MODELS, TINY_MODEL
from ray_hsdp.config.kernels import PROJECT_BACKENDS, GroupKernels
from ray_hsdp.config.pairs import refuse_config
from ray_hsdp.config.topology import ParallelDims

#: The components a LoRA pair names (a two-expert model's high- and low-noise halves).
LORA_COMPONENTS = ("transformer", "transformer_2")

#: Requests a rank can be handed at once: the threads its ``offer`` calls wait on.
MAX_REQUESTS_PER_RANK = 8

#: What every rank imports before it reads a weight (``RankStart.prepare``). A node whose Ray
#: starts with them in ``RAY_preload_python_modules`` keeps idle workers that imported them ahead,
#: and a rank that Ray places on one skips them (one H200: a group's rank processes and imports
#: 18.7 s -> 2.3 s; ``bench.prestart``).
RANK_MODULES = ("torch", "diffusers", "transformers", "ray_hsdp.pipeline.sharded")


def rank_pool_env(rank_pool_size: int | None) -> dict[str, str]:
    """The environment of a Ray that ray-hsdp starts itself (``ray-hsdp serve``, ``demo``) for a
    pool of ``rank_pool_size`` idle worker processes per node that have imported ``RANK_MODULES``:
    Ray's module preload, its idle workers kept up to ``num_workers_soft_limit`` (None: Ray's
    default, the node's CPUs; 0: no preload, each rank imports at its start). Ray does not refill
    the pool as ranks take its workers; a node that keeps more idle workers than it has GPUs has
    one left for a lost rank's replacement."""
    if rank_pool_size == 0:
        return {}
    env = {"RAY_preload_python_modules": ",".join(RANK_MODULES)}
    if rank_pool_size is not None:
        env["RAY_num_workers_soft_limit"] = str(rank_pool_size)
    return env


#: CPUs a CPU rank reserves unless ``cpus_per_rank`` says otherwise.
CPU_RANK_CPUS = 0.5

#: Pipeline components sharded by default: the transformers (both experts of a two-expert
#: pipeline) and the text encoders. VAEs are small next to them and stay replicated.
DEFAULT_SHARD_COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3")


def check_attention_backend_name(name: str) -> None:
    """Refuses a name diffusers does not know, and the ``*_hub`` backends, which download their
    kernels from the Hugging Face Hub at first use (our hosts cannot reach it).

    Raises:
        ValueError: Naming ``attention_backend`` and the backends that can be used.
    """
    from diffusers.models.attention_dispatch import AttentionBackendName  # keeps diffusers, torch out of CLI/ingress

    if name in PROJECT_BACKENDS:
        return
    known = [b.value for b in AttentionBackendName if not b.value.endswith("_hub")] + list(PROJECT_BACKENDS)
    if name.endswith("_hub"):
        raise ValueError(
            f"attention_backend={name!r} downloads its kernels from the Hub at first use; use one of {known}"
        )
    if name not in known:
        raise ValueError(f"attention_backend={name!r} is not a diffusers attention backend; known: {known} or 'auto'")


class ServedModel(BaseModel):
    """What a group serves: the pipeline's folder, its name, device and dtype."""

    model: str = Field(
        TINY_MODEL,
        description=f"Path of a diffusers pipeline folder, or {TINY_MODEL!r} for the embedded tiny Wan pipeline "
        "('tiny-i2v': its image-to-video variant; 'tiny-qwen-image', 'tiny-flux2', 'tiny-hunyuanvideo-1.5', "
        "'tiny-wan2.2-ti2v': the tiny variants of those models, for CPU tests).",
    )
    model_name: str | None = Field(None, description="Name the model is served under; defaults to the folder's name.")
    pipeline_class: str | None = Field(
        None,
        description="The diffusers pipeline class the model folder loads as, in place of the one its "
        "model_index.json names (None): e.g. WanImageToVideoPipeline on a Wan2.2-TI2V-5B folder, which names "
        "WanPipeline, makes videos from a first frame.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description="Device kind of the ranks: 'cuda' (NCCL), 'cpu' (gloo), "
        "or 'auto' (cuda if the Ray cluster has GPUs).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype; 'auto' is bfloat16 on cuda and float32 on cpu."
    )
    allow_pickle: bool = Field(False, description="Also load pickle (.bin) checkpoints; only safetensors otherwise.")


class GroupLayout(BaseModel):
    """How a group's ranks hold and run the pipeline: sizes, lanes, sharding, gathers, ticks."""

    world_size: int | None = Field(
        None, ge=1, description="Total ranks of the pool (replicate_size x shard_size); checked when given."
    )
    replicate_size: int = Field(1, ge=1, description="Number of shard groups (Serve replicas).")
    shard_size: int = Field(
        -1,
        description="Ranks per shard group; each holds 1/shard_size of every sharded module. "
        "-1: world_size // replicate_size; without world_size, the lane size (cfg x ring x ulysses) when "
        "requests are split, else 2.",
    )
    mode: Literal["batch", "replicated"] = Field(
        "batch",
        description="'batch': each lane runs its own requests: lanes of one rank (S requests at a time), or of "
        "cfg x ring x ulysses ranks in combined mode; 'replicated': every rank runs the same request "
        "(memory-only HSDP).",
    )
    lane_sizes: tuple[int, ...] = Field(
        (),
        description="Adaptive lanes: the lane sizes (ranks) a request may run on, e.g. [1, 2]. The group gives "
        "each request its lane when it takes it: a lone request the widest free lane, a backlog lanes of one rank "
        "(a request may name its lane_size). A lane of k ranks is an aligned block that splits the request's "
        "tokens over k ranks (Ulysses, by all-to-all over the heads); with cfg_parallel a lane of 2 or more is two "
        "CFG halves of k/2 Ulysses ranks each. Empty: every lane is fixed by ulysses_degree, ring_degree and "
        "cfg_parallel.",
    )
    lane_widening: bool = Field(
        False,
        description="Adaptive lanes (lane_sizes): while no request waits, a running request's forwards also run on "
        "the idle ranks of the widest aligned lane around its own that its tokens split over. Those ranks join at "
        "its next forward and take each forward's inputs from its lane (a broadcast); its loop, decode and answer "
        "stay on its own lane. A request that arrives takes them back at the next tick. Not for a request that "
        "names its lane_size.",
    )
    ulysses_degree: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallel inside a lane: each request's tokens are split over this many "
        "ranks, which exchange attention heads by all-to-all (diffusers' ContextParallelConfig). Must divide the "
        "transformer's attention heads and each request's token count.",
    )
    ring_degree: int = Field(
        1,
        ge=1,
        description="Ring attention inside a lane: tokens split over this many ranks that pass keys and values "
        "around. Needs an attention backend that returns the log-sum-exp (CUDA: _native_cudnn, _native_flash).",
    )
    cfg_parallel: bool = Field(
        False,
        description="Run the conditional and unconditional forwards of each denoising step on two different "
        "ranks of a lane at once (lanes of 2 x ring x ulysses ranks).",
    )
    shard_components: tuple[str, ...] = Field(
        DEFAULT_SHARD_COMPONENTS, description="Pipeline components to shard when present; all others stay replicated."
    )
    min_num_params: int = Field(
        50_000_000,
        ge=1,
        description="Size rule of the last policy fallback: a submodule this large becomes a sharded unit.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free the gathered weights of a unit after its forward (memory) instead of keeping them (speed).",
    )
    gather: Literal["auto", "fsdp2", "in_place"] = Field(
        "auto",
        description="How a unit's sharded weights are gathered for its forward. 'fsdp2': FSDP2's flat all-gather, "
        "copied into and out of a buffer each forward; 'in_place': each weight gathered straight into buffers its "
        "module reads (no copies; forward_prefetch + 1 units' buffers held at all times). 'auto': in_place on CUDA "
        "(NCCL sends a unit's gathers as one group), fsdp2 on CPU (gloo sends each weight's gather on its own), "
        "fsdp2 with reshard_after_forward=False.",
    )
    nccl_max_ctas: int | None = Field(
        None,
        ge=1,
        description="CUDA: the most SMs (CTAs) NCCL's kernels take per collective (NCCL_MAX_CTAS of the ranks' "
        "communicators). Fewer leave more SMs to the forward's kernels that run beside the prefetched gathers, "
        "and make each collective slower (a lane's Ulysses all-to-alls wait on theirs). None: NCCL's choice.",
    )
    requests_per_rank: int = Field(
        2,
        ge=1,
        le=MAX_REQUESTS_PER_RANK,
        description="Requests one rank works on at once: while one decodes its video, the next denoises. "
        f"At most {MAX_REQUESTS_PER_RANK} (the threads a rank waits on them with).",
    )
    forward_prefetch: int = Field(
        1,
        ge=0,
        description="Units whose weights a unit's forward starts gathering ahead (explicit prefetch); "
        "0: FSDP2's implicit behaviour, or each unit gathered in place when its forward starts.",
    )
    keep_gathered: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the sharded diffusers models' units (the transformers' blocks; text encoders run once "
        "per request and stay as they are) that every rank gathers once, after the load, and keeps whole, spread "
        "evenly over the stack: fewer bytes gathered per forward for more weights per GPU. 1 keeps the root too: "
        "no gathers in a forward, a transformer's whole weights on every GPU.",
    )
    max_forward_batch: int = Field(
        1,
        ge=1,
        description="Most of a rank's waiting calls of one sharded module (different requests of the same "
        "shape) that run as one batched forward, which gathers the weights once for all of them; 1: one call "
        "per forward.",
    )
    tick_exchange: Literal["auto", "host", "device"] = Field(
        "auto",
        description="Where the tick's all-gather (which forward each rank runs next) travels. 'host': gloo over "
        "TCP, so a rank agrees on and queues its next forward while its GPU still runs the last one; 'device': "
        "NCCL on the GPU's stream, so every tick waits for the rank's queued kernels to finish and the GPU "
        "idles while the next forward is launched. 'auto': host.",
    )
    cpus_per_rank: float | None = Field(
        None,
        gt=0,
        description="CPUs reserved per rank in its placement-group bundle; None: 1 on cuda, "
        f"{CPU_RANK_CPUS} on cpu (a gloo rank computes little between collectives, and 4 of them must fit a "
        "2-core laptop).",
    )


class GroupQueue(BaseModel):
    """How a group queues requests and how long each step of a request's life may take."""

    queue_lookahead: int = Field(
        16, ge=1, description="Queued requests the scheduler looks through to find one of similar cost."
    )
    queue_max_skip_s: float = Field(
        10.0, ge=0, description="A queued request passed over for cost this long is taken next regardless."
    )
    max_queue: int = Field(
        64,
        ge=0,
        description="Requests a group holds queued beyond those its ranks run at once; more are refused "
        "(HTTP 429). 0: no queue, only what the ranks can run.",
    )
    rendezvous_timeout_s: float = Field(120.0, gt=0, description="Deadline for the ranks to form their process group.")
    collective_timeout_s: float = Field(600.0, gt=0, description="Timeout of every collective of the process group.")
    load_timeout_s: float = Field(1800.0, gt=0, description="Deadline for the ranks to load and shard the pipeline.")
    mend_lost_rank: bool = Field(
        True,
        description="A group that loses one rank replaces that rank alone: the other ranks keep their processes, "
        "shards and compiled graphs, the new rank loads its own slices, and the group forms its process groups "
        "anew; the requests it ran fail as a lost group's do (the ingress retries them) and its queue waits. "
        "Off, or where the group cannot (one rank, lanes split by context or CFG parallel, keep_gathered, fp8 "
        "quantized at the load), or when the mend fails: the whole group is rebuilt.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline for one request, from the moment a rank takes it (HTTP 504 past it)."
    )
    queue_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest a request waits before a rank takes it, counted from its arrival: for a failed group's "
        "rebuild, in the group's queue and on a group that takes a queued video job over, all together (HTTP 504 "
        "past it). A request run again on another group (the ingress' retry, a released video job placed there) "
        "waits anew from then. Long enough for a full queue of long videos ahead of it.",
    )


class GroupSleep(BaseModel):
    """Where a group's weights rest while its model sleeps (a GPU share's model, or ``ShardGroup.sleep``)."""

    sleep_level: Literal[1, 2] = Field(
        1,
        description="1: a sleep copies each rank's weights into pinned host memory reserved at start (as many bytes "
        "as the rank holds; a wake copies them back at the host-to-device link's speed). 2: for hosts that cannot "
        "hold every sleeping model in memory: the first sleep writes each rank's weights to a file of its own in "
        "sleep_dir, every sleep drops them from the device, and a wake reads the file back (from the page cache "
        "where the kernel kept it, else from the disk); host memory held is a few staging buffers per rank.",
    )
    sleep_dir: str | None = Field(
        None,
        description="sleep_level 2: the folder on each node where its ranks write their weights (its disk needs the "
        "bytes of every rank there). None: ray_hsdp-sleep in the system's temporary folder.",
    )

    @property
    def sleep_folder(self) -> str:
        """Where a level-2 sleep writes this node's ranks' weights."""
        return self.sleep_dir or os.path.join(tempfile.gettempdir(), "ray_hsdp-sleep")


class RequestFeatures(BaseModel):
    """What requests may choose per request: LoRA adapters and step caches."""

    loras: dict[str, str | dict[str, str]] = Field(
        default_factory=dict,
        description="LoRA adapters every rank loads at start, under the names requests choose them by: a LoRA file "
        "or folder in a format diffusers' loader of the pipeline reads (PEFT / diffusers keys, or original-repo keys "
        "it converts), or for a two-expert model a pair {transformer: ..., transformer_2: ...} (Wan2.2's high- and "
        f"low-noise halves). {', '.join(EMBEDDED_LORAS)}: the embedded tiny model's random adapters.",
    )
    max_loras: int = Field(
        8,
        ge=0,
        description="Most adapters in loras: each stays on every rank (a rank-64 LoRA on every block linear of a "
        "Wan-14B transformer is about 0.6 GB per rank in bf16).",
    )
    max_loras_per_request: int = Field(4, ge=1, description="Most adapters one request may combine.")
    fuse_loras: dict[str, float] = Field(
        default_factory=dict,
        description="Adapters of loras merged into the base weights while each rank loads its slices, name -> "
        "scale (W += scale * B @ A): every request runs with them at no cost per step (a step-distillation LoRA), "
        "and no request names them. Works with compile.",
    )
    sample_solver: Literal["unipc", "euler"] | None = Field(
        None,
        description="The scheduler a request runs its steps with when it names none (its sample_solver, or "
        "extra_params.sample_solver): unipc (diffusers' UniPC multistep with flow sigmas, Wan's default) or euler "
        "(diffusers' flow-match Euler, what step-distilled LoRAs such as lightx2v's are trained with), each at the "
        "pipeline's shift or the request's flow_shift. None: the pipeline's own scheduler. A scheduler without a "
        "static shift (FLUX.1's, Qwen-Image's) refuses it at start.",
    )
    scheduler_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the pipeline's scheduler that replace its folder's (diffusers' from_config), for "
        "a distilled model that runs its own schedule: Qwen-Image-Lightning's {base_shift: 1.0986, max_shift: 1.0986, "
        "shift_terminal: null, time_shift_type: exponential}. {}: the folder's.",
    )
    cache: StepCacheConfig = Field(
        default_factory=StepCacheConfig,
        description="Step caching (an opt-in approximation): the kind whose hooks every rank loads, and the settings "
        "requests get; a request may turn it off or set its own (its 'cache' field).",
    )


class GroupConfig(RequestFeatures, GroupSleep, GroupQueue, GroupKernels, GroupLayout, ServedModel):
    """How one shard group loads, shards and runs a diffusers pipeline: the fields of its concerns
    (the bases, listed last first: pydantic orders the fields of the last base first) and the
    checks and facts that need several of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _check_sizes(self) -> GroupConfig:
        if self.shard_size == 0 or self.shard_size < -1:
            raise ValueError(f"shard_size must be >= 1 (or -1 for auto), got {self.shard_size}")
        if self.world_size is not None:
            if self.world_size % self.replicate_size:
                raise ValueError(
                    f"world_size={self.world_size} is not divisible by replicate_size={self.replicate_size}"
                )
            if self.shard_size != -1 and self.replicate_size * self.shard_size != self.world_size:
                raise ValueError(
                    f"replicate_size x shard_size must equal world_size: "
                    f"{self.replicate_size} x {self.shard_size} != {self.world_size}"
                )
        if not self.model:
            raise ValueError(f"model must name a diffusers pipeline folder or one of {', '.join(EMBEDDED_MODELS)}")
        if not self.shard_components:
            raise ValueError("shard_components must name at least one pipeline component")
        if self.attention_backend != "auto":
            check_attention_backend_name(self.attention_backend)
        self.parallel_dims()  # its errors name the fields
        if len(self.loras) > self.max_loras:
            raise ValueError(f"loras registers {len(self.loras)} adapters; max_loras={self.max_loras}")
        for name, source in self.loras.items():
            if not name or any(c in name for c in ",: ") or name.strip() != name:
                raise ValueError(f"lora name {name!r}: use letters, digits, '-', '_' or '.' (no ',', ':' or spaces)")
            if isinstance(source, dict) and (not source or set(source) - set(LORA_COMPONENTS)):
                raise ValueError(
                    f"lora {name!r}: a pair names {' and/or '.join(LORA_COMPONENTS)}, got {sorted(source)}"
                )
        for name, scale in self.fuse_loras.items():
            if name not in self.loras:
                raise ValueError(f"fuse_loras names {name!r}, which loras does not register")
            if scale != scale or abs(scale) == float("inf"):
                raise ValueError(f"fuse_loras {name!r}: the scale must be finite, got {scale}")
        if self.lane_widening and not self.lane_sizes:
            raise ValueError("lane_widening widens adaptive lanes: set lane_sizes too")
        refuse_config(self)
        return self

    def parallel_dims(self) -> ParallelDims:
        """The pool's mesh arithmetic; the caller builds it once and passes it down.

        Raises:
            ValueError: The lanes do not divide the shard size, or mode and lanes conflict.
        """
        return ParallelDims(
            self.replicate_size,
            self.resolved_shard_size,
            cfg=2 if self.cfg_parallel else 1,
            ring=self.ring_degree,
            ulysses=self.ulysses_degree,
            replicated=self.mode == "replicated",
            lane_sizes=tuple(sorted(set(self.lane_sizes))),
        )

    @property
    def resolved_shard_size(self) -> int:
        """The shard size with ``-1`` resolved."""
        if self.shard_size != -1:
            return self.shard_size
        if self.world_size is not None:
            return self.world_size // self.replicate_size
        split = self.ulysses_degree * self.ring_degree * (2 if self.cfg_parallel else 1)
        return split if split > 1 else 2

    def lora_sources(self, fused: bool | None = None) -> dict[str, dict[str, str]]:
        """Adapter name -> component -> source (a path, or an embedded adapter's name).

        Args:
            fused: Only the adapters of ``fuse_loras`` (True), only the others (False), or all.
        """
        return {
            name: dict(source) if isinstance(source, dict) else {"transformer": source}
            for name, source in self.loras.items()
            if fused is None or (name in self.fuse_loras) == fused
        }

    @property
    def served_model_name(self) -> str:
        """The name clients use in the ``model`` field."""
        if self.model_name:
            return self.model_name
        return EMBEDDED_MODELS.get(self.model) or Path(self.model).name

    def resolve_device(self, cluster_has_gpus: bool) -> GroupConfig:
        """Returns a copy with ``device``, ``dtype``, ``cpus_per_rank``, ``gather`` and ``tick_exchange``
        made concrete.

        Args:
            cluster_has_gpus: Whether the Ray cluster offers GPUs (decides ``device='auto'``).

        Raises:
            ValueError: The resolved device meets a setting of the table of refusals (``pairs``).
        """
        device = self.device if self.device != "auto" else ("cuda" if cluster_has_gpus else "cpu")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        cpus = self.cpus_per_rank if self.cpus_per_rank is not None else (1.0 if device == "cuda" else CPU_RANK_CPUS)
        gather = self.gather
        if gather == "auto":
            gather = "in_place" if device == "cuda" and self.reshard_after_forward else "fsdp2"
        tick = self.tick_exchange if self.tick_exchange != "auto" else "host"
        resolved = self.model_copy(
            update={"device": device, "dtype": dtype, "cpus_per_rank": cpus, "gather": gather, "tick_exchange": tick}
        )
        refuse_config(resolved)  # 'auto' may have resolved into a pair of the table
        return resolved
