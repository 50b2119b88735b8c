"""How a rank starts (``RankStart``, a builder the ``Rank`` actor owns): finds the model files, joins
the process group and meshes, loads its shard of the pipeline as a short list of named steps, and
builds its runtime, which it hands back (``LoadedRank``). Modules that import torch are imported
inside the methods (see ``ray_hsdp.rank.actor``)."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from dataclasses import dataclass

import ray

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.config.topology import ParallelDims
from ray_hsdp.phases import Phases
from ray_hsdp.protocol import lane_of
from ray_hsdp.runtime import RankRuntime
from ray_hsdp.variant import RankFeatures

logger = logging.getLogger("ray_hsdp")


def use_compile_cache(folder: str) -> None:
    """Points inductor (its FX graph and AOTAutograd caches) and Triton at ``folder``.

    Torch reads these variables when it compiles, so they are set before anything in this process
    compiles (the FP8 load compiles the activations' scaling)."""
    root = os.path.abspath(os.path.expanduser(folder))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")


@dataclass
class LoadedRank:
    """What a rank's load made (``RankStart.load``): its pipeline and the runtime that runs it, and
    what the load cost."""

    #: This rank's shard of the pipeline (``ShardedPipeline``).
    pipeline: object
    #: The rank's execution: its request threads, and its tick thread when sharded.
    runtime: RankRuntime
    #: Seconds the load took.
    load_s: float
    #: The most host memory this process held above its level before loading, sampled while loading.
    peak_rss_bytes: int


def where_it_runs(rank: int, config: GroupConfig, preloaded: bool) -> dict:
    """Where this rank runs: rank, node id and IP, placement group, namespace, pid, device."""
    from ray_hsdp import distributed

    context = ray.get_runtime_context()
    return {
        "rank": rank,
        "node_id": context.get_node_id(),
        # The placement group this process runs in, as Ray reports it (its group's, a replica's).
        "placement_group": context.get_placement_group_id(),
        "namespace": context.namespace,
        "node_ip": distributed.node_ip(),
        "pid": os.getpid(),
        "preloaded": preloaded,
        "device": config.device,
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
    }


def cache_hooks(config: GroupConfig) -> dict | None:
    """The step cache's hooks the sharded models take at load (``step_cache.enable``)."""
    cache = config.cache
    if cache.kind == "none":
        return None
    return {"kind": cache.kind, "max_order": cache.max_order, "lite": cache.lite}


def mend_refusal(config: GroupConfig, dims: ParallelDims, model_path) -> str | None:
    """Why this group cannot replace a lost rank alone (its load needs collectives of every
    rank, or its process groups are held where a new rendezvous cannot renew them), or None.
    A group that cannot is rebuilt whole."""
    from ray_hsdp.loading.fp8_folder import read_record

    reasons = {
        "a group of one rank has no survivor": dims.shard_size == 1,
        "mend_lost_rank is off": not config.mend_lost_rank,
        "lanes split by context or CFG parallel": dims.lane_size > 1 or dims.adaptive,
        "keep_gathered (or reshard_after_forward: false) gathers at the load": (
            config.keep_gathered > 0 or not config.reshard_after_forward
        ),
        "quantization fp8 of a model that is not an FP8 folder quantizes at the load": (
            config.quantization == "fp8" and read_record(model_path) is None
        ),
    }
    return next((reason for reason, holds in reasons.items() if holds), None)


class RankStart:
    """A rank's start, in order: ``prepare`` (model files, imports), ``address`` (rendezvous),
    ``join`` (process group, meshes), ``load`` (the pipeline and its runtime, as ``LoadedRank``).
    It holds what the start found and joined, which a survivor of a mended group joins again with.

    Args:
        rank: Index in the group.
        config: The group's configuration, with device and dtype resolved.
        dims: The pool's mesh arithmetic.
        phases: Where this rank's part of the group's start goes.
    """

    def __init__(self, rank: int, config: GroupConfig, dims: ParallelDims, phases: Phases):
        self.rank = rank
        self.config = config
        self.dims = dims
        self.phases = phases
        self.model_path = None
        self.lora_paths: dict = {}
        self._rendezvous = None  # rank 0's rendezvous store, bound in ``address``
        self.mesh = self.lane_mesh = None
        self.lane_meshes: dict = {}
        self.decode_groups = {}  # lane size -> the process group of this rank's lane of that size, for split decodes
        self.tick_group = None  # with tick_exchange "host": the gloo group of the tick's all-gather

    def prepare(self) -> str:
        """Finds the model folder on this node (writing the embedded tiny model if needed) and
        imports the classes of its components.

        Runs before the process group exists: model writers save only on distributed rank 0.
        """
        if self.config.compile_cache_dir:
            use_compile_cache(self.config.compile_cache_dir)
        # Code first, weights later: the load's memory report then counts weights only, and its
        # time is the weights'.
        with self.phases.phase("imports"):
            # The loader pulls in torch's DTensor, dynamo and sympy: seconds on a GPU host.
            from ray_hsdp.loading.components import import_component_classes, resolve_lora_path, resolve_model_path
        with self.phases.phase("model files"):
            self.model_path = resolve_model_path(self.config.model)
            self.lora_paths = {
                name: {component: resolve_lora_path(source) for component, source in parts.items()}
                for name, parts in self.config.lora_sources().items()
            }
        with self.phases.phase("imports"):  # adds to the phase above
            import_component_classes(self.model_path)
            importlib.import_module("ray_hsdp.pipeline.sharded")
        return str(self.model_path)

    def address(self) -> tuple[str, int]:
        """This node's IP and the port of the rendezvous store this rank binds there: rank 0's
        answer is the group's rendezvous address (0: a group of one rank has none)."""
        from ray_hsdp import distributed

        ip = distributed.node_ip()
        if self.dims.shard_size == 1:
            return ip, 0
        self._rendezvous = distributed.bind_rendezvous(ip, self.dims.shard_size, self.config.rendezvous_timeout_s)
        return ip, self._rendezvous.port

    def join(self, master: str, port: int, survivor: LoadedRank | None = None) -> None:
        """Joins the process group and builds the meshes; a survivor of a mended group (its load
        in ``survivor``) keeps its shards and moves them, and its runtime, to the new groups."""
        from ray_hsdp import distributed

        if survivor is not None:
            distributed.destroy_process_group()  # what is left of the lost one (aborted on NCCL)
        if self.dims.shard_size > 1:
            with self.phases.phase("process group"):
                timeout_s = self.config.rendezvous_timeout_s
                store = self._rendezvous or distributed.connect_rendezvous(
                    master, port, self.dims.shard_size, timeout_s
                )
                distributed.init_process_group(
                    self.config.device,
                    store,
                    self.rank,
                    self.dims.shard_size,
                    self.config.collective_timeout_s,
                    high_priority=self.config.request_streams,
                )
            with self.phases.phase("meshes"):
                # Formed in the same order on every rank, a survivor's too: each process group
                # gets the name its predecessor had, which the meshes the shards hold resolve.
                meshes = distributed.build_meshes(self.config.device, self.dims)
                lane_meshes = distributed.adaptive_lane_meshes(self.config.device, self.dims)
                if survivor is None:
                    (self.mesh, self.lane_mesh), self.lane_meshes = meshes, lane_meshes
                if self.config.tick_exchange == "host":  # on CPUs too: the path GPUs take, tested here
                    self.tick_group = distributed.host_tick_group(self.config.collective_timeout_s)
                if self.config.vae_parallel != "off":
                    timeout_s = self.config.collective_timeout_s
                    self.decode_groups = distributed.lane_decode_groups(self.dims, self.rank, timeout_s)
        else:
            self.mesh = self.lane_mesh = None
            self.lane_meshes = {}
        if survivor is not None:
            self._rejoined(survivor)

    def _rejoined(self, survivor: LoadedRank) -> None:
        """A survivor's shards, tick exchange and runtime on the group's new process groups."""
        from ray_hsdp import distributed
        from ray_hsdp.runtime.modules import ProcessGroupExchange

        for mesh in (self.mesh, self.lane_mesh):
            distributed.refresh_mesh(mesh)
        for sharding in survivor.pipeline.shardings.values():
            sharding.rejoined()
        if isinstance(survivor.runtime.exchange, ProcessGroupExchange):
            survivor.runtime.exchange.group = self.tick_group
        survivor.runtime.recover(self.config.collective_timeout_s)

    def load(self) -> LoadedRank:
        """Loads the pipeline, its sharded components slice by slice, and builds the runtime,
        sampling the host memory the load holds (``RssSampler``)."""
        from ray_hsdp.memory import RssSampler

        if self.model_path is None:
            raise RuntimeError("prepare() must run before load()")
        if self.rank == 0:
            dims = self.dims
            logger.info(
                "HSDP Inference: replicate_size=%d, shard_size=%d, lanes=%d x (cfg %d x ring %d x ulysses %d)",
                dims.replicate_size, dims.shard_size, dims.num_lanes, dims.cfg, dims.ring, dims.ulysses,
            )  # fmt: skip
        with RssSampler() as rss:
            start = time.perf_counter()
            pipeline = self._load_pipeline()
            runtime = self._runtime_of(pipeline)
            self._serve_settings(pipeline)
            load_s = time.perf_counter() - start
        return LoadedRank(pipeline, runtime, load_s, rss.peak_above_start)

    def _runtime_of(self, pipeline) -> RankRuntime:
        """The runtime of the loaded ``pipeline``: its features (adapters, step caches), its split
        decodes, and on a sharded rank the stand-ins its sharded modules' calls go through."""
        from ray_hsdp.runtime.cfg import CfgSplit

        features = RankFeatures(
            self._load_adapters(pipeline),
            adapters_per_forward=bool(pipeline.sharded),
            lane_parallel=pipeline.features.lane_parallel,
        )
        modules, exchange = self._sharded_modules(pipeline, features)
        pipeline.features = features
        if self.decode_groups:
            from ray_hsdp.pipeline.lane_tiles import LaneTiles

            # A lane is an aligned block of ranks: this rank's place in its lane of each size.
            pipeline.lane_tiles = {
                size: LaneTiles(group, self.rank % size, size, self.config.device)
                for size, group in self.decode_groups.items()
            }
        runtime = RankRuntime(
            pipeline.run,
            rank=self.rank,
            slots=self.config.requests_per_rank,
            modules=modules,
            exchange=exchange,
            max_batch=self.config.max_forward_batch,
            lane_decodes=pipeline.splits_decode if self.decode_groups else None,
        )
        if modules is not None:
            split = CfgSplit(runtime.call, functools.partial(self._cfg_half, runtime), pipeline.guided)
            # Before the request slots are copied from the pipeline: every slot must call the
            # stand-ins, or a request thread would issue collectives of its own.
            pipeline.route_calls(modules.proxies(runtime.call, {name: split for name in pipeline.cfg_split}))
        return runtime

    def _serve_settings(self, pipeline) -> None:
        """The loaded pipeline's request slots and how they decode, as the configuration says."""
        config = self.config
        if config.vae_channels_last:
            pipeline.vae_channels_last()
        with self.phases.phase("request slots"):  # each slot's own VAE and scheduler
            pipeline.set_request_slots(config.requests_per_rank, config.shard_components)
        pipeline.request_streams = config.request_streams
        pipeline.vae_tiling = (config.vae_tiling, config.vae_tiling_above_pixels)
        pipeline.vae_parallel = config.vae_parallel

    def _load_pipeline(self):
        """The pipeline, its sharded components read slice by slice (``ShardedPipeline.load``)."""
        from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline

        config = self.config
        return ShardedPipeline.load(self.model_path, LoadOptions(
            dtype=config.dtype, device=config.device, rank=self.rank, mesh=self.mesh,
            shard_components=config.shard_components, min_num_params=config.min_num_params,
            reshard_after_forward=config.reshard_after_forward, forward_prefetch=config.forward_prefetch,
            keep_gathered=config.keep_gathered, gather=config.gather, allow_pickle=config.allow_pickle,
            dims=self.dims, lane_mesh=self.lane_mesh, lane_meshes=self.lane_meshes,
            attention_backend=config.attention_backend, compile=config.compile,
            fuse_loras={name: (scale, self.lora_paths[name]) for name, scale in config.fuse_loras.items()},
            cache_hooks=cache_hooks(config), quantization=config.quantization, phases=self.phases,
            pipeline=config.pipeline_class, sample_solver=config.sample_solver,
            scheduler_config=config.scheduler_config,
        ))  # fmt: skip

    def _load_adapters(self, pipeline):
        """The switched adapters (all but the fused ones), or None."""
        switched = {name: parts for name, parts in self.lora_paths.items() if name not in self.config.fuse_loras}
        if not switched:
            return None
        from ray_hsdp.loading.adapters import Adapters

        # After fully_shard: the adapters stay plain replicated parameters beside the units.
        with self.phases.phase("adapters"):
            return Adapters.load(pipeline.pipe, switched)

    def _sharded_modules(self, pipeline, features: RankFeatures):
        """The sharded modules the tick thread runs (each forward in its request's variant, with
        the rank's ``features``, whose step caches are made here) and the tick's exchange;
        ``(None, None)`` on an unsharded rank."""
        from ray_hsdp.runtime.modules import ProcessGroupExchange, ShardedModules, priority_stream

        if not pipeline.sharded:
            return None, None
        if self.config.cache.kind != "none":
            features.step_caches = self._step_caches(pipeline)
        prioritized = self.config.request_streams and self.config.device == "cuda"
        modules = ShardedModules(
            pipeline.sharded_modules,
            self.config.device,
            pipeline.shardings,
            features=features,
            stream=priority_stream() if prioritized else None,
        )
        on_host = self.config.tick_exchange == "host"
        return modules, ProcessGroupExchange("cpu" if on_host else self.config.device, self.tick_group)

    def _step_caches(self, pipeline):
        """The step caches of the loaded sharded modules; a lane that splits the sequence sums
        First Block Cache's measure over its ``ring`` and ``ulysses`` ranks."""
        from ray_hsdp.sharding.step_cache import StepCaches

        dims = {"ring": self.dims.ring, "ulysses": self.dims.ulysses}
        groups = [self.lane_mesh.get_group(name) for name, size in dims.items() if size > 1]
        return StepCaches(list(pipeline.sharded_modules.values()), groups)

    def _cfg_half(self, runtime: RankRuntime) -> tuple[int, object] | None:
        """On a request thread of ``runtime``: the CFG half this rank runs of its request's lane and
        the process group of the lane's two halves; ``None`` when that lane is not CFG-split."""
        if self.dims.cfg != 2:
            return None
        if not self.dims.adaptive:
            return self.dims.cfg_index(self.rank), self.lane_mesh.get_group("cfg")
        first, size = lane_of(runtime.current_ticket())
        cfg, ulysses = self.dims.lane_shape(size)
        if cfg == 1:
            return None
        return (self.rank - first) // ulysses, self.lane_meshes[size].get_group("cfg")
