"""One rank's view of its group: rendezvous, process group, device mesh, teardown."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ray_hsdp.config.topology import LANE_MESH_DIM_NAMES, ParallelDims

#: NVLink multicast (NVLS) hangs or fails on the lent GPU hosts and in many containers; every
#: rank process runs with it off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_nccl_env(max_ctas: int | None = None) -> None:
    """Sets :data:`NCCL_ENV` in this process unless the user set the variables already.

    Args:
        max_ctas: ``NCCL_MAX_CTAS`` of the communicators this process creates (the group's
            ``nccl_max_ctas``, which wins over the environment); None leaves NCCL's choice.
    """
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if max_ctas is not None:
        os.environ["NCCL_MAX_CTAS"] = str(max_ctas)


def node_ip() -> str:
    """This node's IP address as Ray knows it (falls back to the host's own resolution)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray the host name is the best we have
        return socket.gethostbyname(socket.gethostname())


def bind_rendezvous(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, bound on ``host`` at a port the system picks (``.port``) and holds
    from then on: no other process can take it between the pick and the rendezvous (a port found
    free and bound later could be)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def connect_rendezvous(master: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Another rank's client of rank 0's rendezvous store at ``master:port``."""
    return dist.TCPStore(master, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def backend_for(device: str) -> str:
    """NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def init_process_group(
    device: str, store: dist.Store, rank: int, world_size: int, timeout_s: float, high_priority: bool = False
) -> None:
    """Joins the group's process group through its rendezvous ``store`` (``bind_rendezvous`` on
    rank 0, ``connect_rendezvous`` elsewhere).

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        store: The group's rendezvous store.
        rank: This rank's index in the group.
        world_size: Ranks in the group.
        timeout_s: Deadline of the rendezvous and of every later collective.
        high_priority: On CUDA, NCCL's collectives on high-priority streams (with the forwards'
            ``runtime.modules.priority_stream``: a rank's own decode yields to the group's gathers).
    """
    kwargs = {}
    if device == "cuda":
        # Ray masks CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here.
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
        if high_priority:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            kwargs["pg_options"] = options
    dist.init_process_group(
        backend=backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def build_meshes(device: str, dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The group's meshes on its own device type; every rank calls this in the same order.

    Returns:
        ``(shard, lanes)``: FSDP shards over ``shard``, a 1-D view of the whole group's process
        group (no new communicator); ``lanes`` has the dims ``("lane", "cfg", "ring", "ulysses")``
        (``None`` when replicated), whose sub-meshes carry context parallel and the CFG exchange.
    """
    shard = DeviceMesh.from_group(dist.group.WORLD, device, mesh_dim_names=("shard",))
    shape = dims.lane_mesh_shape
    lanes = init_device_mesh(device, shape, mesh_dim_names=LANE_MESH_DIM_NAMES) if shape else None
    return shard, lanes


def adaptive_lane_meshes(device: str, dims: ParallelDims) -> dict[int, DeviceMesh]:
    """Lane size -> the group's mesh of lanes of that size (aligned blocks, each one Ulysses
    lane), for a group of adaptive lanes; every rank calls this in the same order, at start, so no
    request's forward creates a process group."""
    return {
        size: init_device_mesh(
            device,
            (dims.shard_size // size, *dims.lane_shape(size)[:1], 1, dims.lane_shape(size)[1]),
            mesh_dim_names=LANE_MESH_DIM_NAMES,
        )  # fmt: skip
        for size in dims.lane_sizes
        if dims.shard_size > 1
    }


def host_tick_group(timeout_s: float):
    """A gloo process group of the whole group, for the tick's all-gather (every rank calls this, in
    the same order).

    An NCCL all-gather read back with ``tolist`` waits for every kernel the rank has queued, so each
    tick would drain the GPU and launch the next forward into an empty queue. Over gloo the tick
    agrees on the next forward while the GPU still runs the last one."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    dist.all_reduce(torch.ones(1), group=group)  # connects now rather than at the first tick
    return group


def lane_decode_groups(dims: ParallelDims, rank: int, timeout_s: float) -> dict[int, object]:
    """Lane size -> a gloo process group of the ranks of this rank's lane of that size, for the
    lane's split decodes alone: the fixed lane's, or with adaptive lanes (``lane_sizes``) one per
    aligned block of each size above one (every rank calls this, in the same order, at start, so
    no request's decode creates a process group).

    Gloo on GPUs too: a decode's exchange runs on a request thread while the tick thread goes on
    with the group's NCCL collectives, and two NCCL communicators used at once from two threads
    can wait on each other (on 4 x H100 a lane of 4 that shared its decode over NCCL never
    finished its first request). Gloo's collectives run on the host, beside any GPU kernel."""
    sizes = sorted(dims.lane_sizes) if dims.adaptive else [dims.lane_size]
    mine = {}
    for size in (s for s in sizes if s > 1):
        for block in dims.blocks(size):  # a fixed group's lanes are its aligned blocks of lane_size too
            group = dist.new_group(list(block), timeout=timedelta(seconds=timeout_s), backend="gloo")
            if rank in block:
                mine[size] = group
    for group in mine.values():  # connects now rather than in a request's first decode
        dist.all_reduce(torch.ones(1), group=group)
    return mine


def destroy_process_group() -> None:
    """Leaves the process group; a no-op when none was formed."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def abort_process_groups() -> None:
    """Aborts this process's NCCL communicators, so that a thread sitting in a collective with a
    dead peer returns with an error now rather than at the collective timeout, and forgets every
    process group as ``destroy_process_group`` does (the names of the next ones count from the
    start again). Gloo's collectives fail on the dead peer's closed socket by themselves.

    torch has no public abort: ``_abort_process_group`` is what ``destroy_process_group`` runs
    for NCCL when a peer is gone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except (AttributeError, RuntimeError, NotImplementedError, ValueError):  # no abort for this backend
        destroy_process_group()


def refresh_mesh(mesh: DeviceMesh | None) -> None:
    """Points ``mesh`` at the process groups that now carry its group names.

    A mended group forms its process groups again in the same order, so each gets the name its
    predecessor had and a mesh resolves it by name; compiled code reads a mesh's own registry of
    groups instead (``DeviceMesh._pg_registry``), which is filled at its creation."""
    if mesh is None or not hasattr(mesh, "_dim_group_names"):
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    root = mesh._get_root_mesh()
    for each in {id(root): root, id(mesh): mesh}.values():
        if hasattr(each, "_pg_registry"):
            each._pg_registry = {name: _resolve_process_group(name) for name in each._dim_group_names}
