"""Run a test function on N Ray actors that form a real gloo process group and mesh."""

from __future__ import annotations

import sys

import ray
from ray import cloudpickle

from ray_hsdp import distributed
from ray_hsdp.config.topology import ParallelDims


@ray.remote(num_cpus=1)
class GlooWorker:
    def address(self, world_size: int):
        ip = distributed.node_ip()
        self.store = distributed.bind_rendezvous(ip, world_size, timeout_s=120)
        return ip, self.store.port

    def join(self, master: str, port: int, rank: int, world_size: int) -> None:
        store = self.store if rank == 0 else distributed.connect_rendezvous(master, port, world_size, timeout_s=120)
        distributed.init_process_group("cpu", store, rank, world_size, timeout_s=120)
        self.mesh, _ = distributed.build_meshes("cpu", ParallelDims(1, world_size))
        self.rank = rank

    def call(self, fn, *args):
        return fn(self.mesh, self.rank, *args)

    def leave(self) -> None:
        distributed.destroy_process_group()


class GlooGroup:
    """``with GlooGroup(2) as g: g.run(fn, *args)`` runs ``fn(mesh, rank, *args)`` on every rank."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __enter__(self) -> GlooGroup:
        self.workers = [GlooWorker.remote() for _ in range(self.world_size)]
        master, port = ray.get(self.workers[0].address.remote(self.world_size))
        ray.get([w.join.remote(master, port, i, self.world_size) for i, w in enumerate(self.workers)], timeout=120)
        return self

    def run(self, fn, *args, timeout: float = 300):
        # Test modules are not importable on the workers: ship the function's module by value.
        cloudpickle.register_pickle_by_value(sys.modules[fn.__module__])
        return ray.get([w.call.remote(fn, *args) for w in self.workers], timeout=timeout)

    def __exit__(self, *exc) -> None:
        ray.get([w.leave.remote() for w in self.workers], timeout=60)
        for w in self.workers:
            ray.kill(w)
