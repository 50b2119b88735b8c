"""How a rank starts (``Rank``, whose state it fills): finds the model files, joins the process
group and meshes, loads its shard of the pipeline as a short list of named steps, and builds its
runtime. Modules that import torch are imported inside the methods (see ``ray_hsdp.rank.actor``)."""

from __future__ import annotations

import importlib
import logging
import os
import time

import ray

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


class RankStart:
    """The start of a ``Rank``: ``prepare``, ``address``, ``join``, ``load`` (in that order)."""

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

    def join(self, master: str, port: int) -> dict:
        """Joins the process group and builds the mesh.

        Returns:
            Where this rank runs: rank, node id and IP, pid, device.
        """
        from ray_hsdp import distributed

        rejoining = self.pipeline is not None  # a survivor of a mended group: it keeps its shards
        if rejoining:
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
                if not rejoining:
                    (self.mesh, self.lane_mesh), self.lane_meshes = meshes, lane_meshes
                if self.config.tick_exchange == "host":  # on CPUs too: the path GPUs take, tested here
                    self.tick_group = distributed.host_tick_group(self.config.collective_timeout_s)
                if self.config.vae_parallel != "off":
                    timeout_s = self.config.collective_timeout_s
                    self.decode_groups = distributed.lane_decode_groups(self.dims, self.rank, timeout_s)
        else:
            self.mesh = self.lane_mesh = None
            self.lane_meshes = {}
        if rejoining:
            self._rejoined()
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            # The placement group this process runs in, as Ray reports it (its group's, a replica's).
            "placement_group": ray.get_runtime_context().get_placement_group_id(),
            "namespace": ray.get_runtime_context().namespace,
            "node_ip": distributed.node_ip(),
            "pid": os.getpid(),
            "preloaded": self.preloaded,
            "device": self.config.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def _rejoined(self) -> None:
        """A survivor's shards, tick exchange and runtime on the group's new process groups."""
        from ray_hsdp import distributed
        from ray_hsdp.runtime.modules import ProcessGroupExchange

        for mesh in (self.mesh, self.lane_mesh):
            distributed.refresh_mesh(mesh)
        for sharding in self.pipeline.shardings.values():
            sharding.rejoined()
        if isinstance(self.runtime.exchange, ProcessGroupExchange):
            self.runtime.exchange.group = self.tick_group
        self.runtime.recover(self.config.collective_timeout_s)

    def mend_refusal(self) -> str | None:
        """Why this group cannot replace a lost rank alone (its load needs collectives of every
        rank, or its process groups are held where a new rendezvous cannot renew them), or None.
        A group that cannot is rebuilt whole."""
        from ray_hsdp.loading.fp8_folder import read_record

        config, dims = self.config, self.dims
        reasons = {
            "a group of one rank has no survivor": dims.shard_size == 1,
            "mend_lost_rank is off": not config.mend_lost_rank,
            "lanes split by context or CFG parallel": dims.lane_size > 1 or dims.adaptive,
            "keep_gathered (or reshard_after_forward: false) gathers at the load": (
                config.keep_gathered > 0 or not config.reshard_after_forward
            ),
            "quantization fp8 of a model that is not an FP8 folder quantizes at the load": (
                config.quantization == "fp8" and read_record(self.model_path) is None
            ),
        }
        return next((reason for reason, holds in reasons.items() if holds), None)

    def load(self) -> dict:
        """Loads the pipeline, its sharded components slice by slice, and builds the runtime;
        returns the memory report, with the pipeline's facts under ``pipeline``.

        The report adds ``load_s`` and ``load_peak_rss_bytes``: the most host memory this process
        held above its level before loading, sampled while loading.
        """
        from ray_hsdp.memory import RssSampler
        from ray_hsdp.runtime.cfg import CfgSplit

        if self.model_path is None:
            raise RuntimeError("prepare() must run before load()")
        if self.rank == 0:
            logger.info(
                "HSDP Inference: replicate_size=%d, shard_size=%d, lanes=%d x (cfg %d x ring %d x ulysses %d)",
                self.dims.replicate_size,
                self.dims.shard_size,
                self.dims.num_lanes,
                self.dims.cfg,
                self.dims.ring,
                self.dims.ulysses,
            )
        with RssSampler() as rss:
            start = time.perf_counter()
            self.pipeline = self._load_pipeline()
            features = RankFeatures(
                self._load_adapters(),
                adapters_per_forward=bool(self.pipeline.sharded),
                lane_parallel=self.pipeline.features.lane_parallel,
            )
            modules, exchange = self._sharded_modules(features)
            self.pipeline.features = features
            if self.decode_groups:
                from ray_hsdp.pipeline.lane_tiles import LaneTiles

                # A lane is an aligned block of ranks: this rank's place in its lane of each size.
                self.pipeline.lane_tiles = {
                    size: LaneTiles(group, self.rank % size, size, self.config.device)
                    for size, group in self.decode_groups.items()
                }
            self.runtime = self._runtime(modules, exchange)
            if modules is not None:
                split = CfgSplit(self.runtime.call, self._cfg_half, self.pipeline.guided)
                # Before the request slots are copied from the pipeline: every slot must call the
                # stand-ins, or a request thread would issue collectives of its own.
                self.pipeline.route_calls(
                    modules.proxies(self.runtime.call, {name: split for name in self.pipeline.cfg_split})
                )
            if self.config.vae_channels_last:
                self.pipeline.vae_channels_last()
            with self.phases.phase("request slots"):  # each slot's own VAE and scheduler
                self.pipeline.set_request_slots(self.config.requests_per_rank, self.config.shard_components)
            self.pipeline.request_streams = self.config.request_streams
            self.pipeline.vae_tiling = (self.config.vae_tiling, self.config.vae_tiling_above_pixels)
            self.pipeline.vae_parallel = self.config.vae_parallel
            self.load_s = time.perf_counter() - start
        self.load_peak_rss_bytes = rss.peak_above_start
        return {
            **self.memory(),
            "pipeline": self.pipeline.facts,
            "start_phases_s": dict(self.phases.seconds),
            "mend_refusal": self.mend_refusal(),
        }

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
            cache_hooks=self._cache_hooks(), quantization=config.quantization, phases=self.phases,
            pipeline=config.pipeline_class, sample_solver=config.sample_solver,
            scheduler_config=config.scheduler_config,
        ))  # fmt: skip

    def _load_adapters(self):
        """The switched adapters (all but the fused ones), or None."""
        switched = {name: parts for name, parts in self.lora_paths.items() if name not in self.config.fuse_loras}
        if not switched:
            return None
        from ray_hsdp.loading.adapters import Adapters

        # After fully_shard: the adapters stay plain replicated parameters beside the units.
        with self.phases.phase("adapters"):
            return Adapters.load(self.pipeline.pipe, switched)

    def _sharded_modules(self, features: RankFeatures):
        """The sharded modules the tick thread runs (each forward in its request's variant, with
        the rank's ``features``, whose step caches are made here) and the tick's exchange;
        ``(None, None)`` on an unsharded rank."""
        from ray_hsdp.runtime.modules import ProcessGroupExchange, ShardedModules, priority_stream

        if not self.pipeline.sharded:
            return None, None
        if self.config.cache.kind != "none":
            features.step_caches = self._step_caches()
        prioritized = self.config.request_streams and self.config.device == "cuda"
        modules = ShardedModules(
            self.pipeline.sharded_modules,
            self.config.device,
            self.pipeline.shardings,
            features=features,
            stream=priority_stream() if prioritized else None,
        )
        on_host = self.config.tick_exchange == "host"
        return modules, ProcessGroupExchange("cpu" if on_host else self.config.device, self.tick_group)

    def _runtime(self, modules, exchange) -> RankRuntime:
        """The rank's execution: its request threads, and its tick thread when sharded."""
        return RankRuntime(
            self.pipeline.run,
            rank=self.rank,
            slots=self.config.requests_per_rank,
            modules=modules,
            exchange=exchange,
            max_batch=self.config.max_forward_batch,
            lane_decodes=self.pipeline.splits_decode if self.decode_groups else None,
        )

    def _cache_hooks(self) -> dict | None:
        """The step cache's hooks the sharded models take at load (``step_cache.enable``)."""
        cache = self.config.cache
        if cache.kind == "none":
            return None
        return {"kind": cache.kind, "max_order": cache.max_order, "lite": cache.lite}

    def _step_caches(self):
        """The step caches of the loaded sharded modules; a lane that splits the sequence sums
        First Block Cache's measure over its ``ring`` and ``ulysses`` ranks."""
        from ray_hsdp.sharding.step_cache import StepCaches

        dims = {"ring": self.dims.ring, "ulysses": self.dims.ulysses}
        groups = [self.lane_mesh.get_group(name) for name, size in dims.items() if size > 1]
        return StepCaches(list(self.pipeline.sharded_modules.values()), groups)

    def _cfg_half(self) -> tuple[int, object] | None:
        """On a request thread: the CFG half this rank runs of its request's lane and the process
        group of the lane's two halves; ``None`` when that lane is not CFG-split."""
        if self.dims.cfg != 2:
            return None
        if not self.dims.adaptive:
            return self.dims.cfg_index(self.rank), self.lane_mesh.get_group("cfg")
        first, size = lane_of(self.runtime.current_ticket())
        cfg, ulysses = self.dims.lane_shape(size)
        if cfg == 1:
            return None
        return (self.rank - first) // ulysses, self.lane_meshes[size].get_group("cfg")
