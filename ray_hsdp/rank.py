"""The rank actor: one process, one device, one shard of the group's pipeline."""

from __future__ import annotations

import logging
import os
import time

import ray

from ray_hsdp import distributed
from ray_hsdp.config import GroupConfig
from ray_hsdp.memory import RssSampler, device_allocated_bytes
from ray_hsdp.request import GenerationRequest, GenerationResult
from ray_hsdp.topology import ParallelDims

logger = logging.getLogger("ray_hsdp")


#: ``ping`` and ``memory`` run on their own thread, so a health check is answered while a long
#: request runs on the default one.
CONCURRENCY_GROUPS = {"control": 1}


class Rank:
    """One rank of a shard group; the group turns this class into a Ray actor.

    Args:
        rank: Index in the group (0..S-1), which is also its shard index.
        config: The group's configuration, with device and dtype resolved.
    """

    def __init__(self, rank: int, config: GroupConfig):
        distributed.apply_nccl_env()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s rank=" + str(rank) + " %(message)s")
        self.rank = rank
        self.config = config
        self.dims = ParallelDims(config.replicate_size, config.resolved_shard_size)
        self.pipeline = None
        self.model_path = None
        self.load_s = 0.0
        self.load_peak_rss_bytes = 0
        self.last_request_peak_device_bytes = 0

    def prepare(self) -> str:
        """Finds the model folder on this node (writing the embedded tiny model if needed) and
        imports the classes of its components.

        Runs before the process group exists: model writers save only on distributed rank 0.
        """
        from ray_hsdp.loading import import_component_classes, resolve_model_path

        self.model_path = resolve_model_path(self.config.model)
        # Code first, weights later: the load's memory report then counts weights only.
        import_component_classes(self.model_path)
        return str(self.model_path)

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's answer is the group's rendezvous address."""
        ip = distributed.node_ip()
        return ip, distributed.free_port(ip)

    def join(self, master: str, port: int) -> dict:
        """Joins the process group and builds the mesh.

        Returns:
            Where this rank runs: rank, node id and IP, pid, device.
        """
        if self.dims.shard_size > 1:
            distributed.init_process_group(
                self.config.device, master, port, self.rank, self.dims.shard_size, self.config.collective_timeout_s
            )
            self.mesh = distributed.build_mesh(self.config.device, self.dims.group_mesh_shape)
        else:
            self.mesh = None
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": distributed.node_ip(),
            "pid": os.getpid(),
            "device": self.config.device,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def load(self) -> dict:
        """Loads the pipeline, its sharded components slice by slice; returns the memory report.

        The report adds ``load_s`` and ``load_peak_rss_bytes``: the most host memory this process
        held above its level before loading, sampled while loading.
        """
        from ray_hsdp.sharded_pipeline import ShardedPipeline

        if self.model_path is None:
            raise RuntimeError("prepare() must run before load()")
        if self.rank == 0:
            logger.info(
                "HSDP Inference: replicate_size=%d, shard_size=%d", self.dims.replicate_size, self.dims.shard_size
            )
        with RssSampler() as rss:
            start = time.perf_counter()
            self.pipeline = ShardedPipeline.load(
                self.model_path,
                dtype=self.config.dtype,
                device=self.config.device,
                rank=self.rank,
                mesh=self.mesh,
                shard_components=self.config.shard_components,
                min_num_params=self.config.min_num_params,
                reshard_after_forward=self.config.reshard_after_forward,
                allow_pickle=self.config.allow_pickle,
            )
            self.load_s = time.perf_counter() - start
        self.load_peak_rss_bytes = rss.peak_above_start
        return self.memory()

    def run(self, request: GenerationRequest) -> GenerationResult:
        """Runs one request; every rank of the group must be running a request of the same wave key."""
        if self.pipeline is None:
            raise RuntimeError(f"rank {self.rank} has no pipeline loaded")
        result = self.pipeline.run(request)
        self.last_request_peak_device_bytes = result.peak_device_bytes
        return result

    @ray.method(concurrency_group="control")
    def memory(self, units: bool = False) -> dict:
        """The memory report of this rank (see ``ShardedPipeline.memory``)."""
        report = self.pipeline.memory(units=units) if self.pipeline is not None else {}
        return {
            "rank": self.rank,
            "shard_index": self.rank,
            "device": self.config.device,
            "load_s": round(self.load_s, 3),
            "load_peak_rss_bytes": self.load_peak_rss_bytes,
            "load_bytes_read": sum(s["bytes_read"] for s in self.pipeline.load_stats.values()) if self.pipeline else 0,
            "device_allocated_bytes": device_allocated_bytes(self.config.device),
            "last_request_peak_device_bytes": self.last_request_peak_device_bytes,
            **report,
        }

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        """Answers with the rank index; the group's health check."""
        return self.rank

    def leave(self) -> None:
        """Destroys the process group (the actor is killed right after)."""
        distributed.destroy_process_group()
