"""Memory that every rank of a group on one node can read: each rank's buffer, seen from all ranks.

A rank's sharded weights never change after the load, so a rank that needs another rank's rows can
read them whenever it likes, with no collective and no handshake: only the one barrier after every
rank has written its buffer. On CUDA the buffers are torch symmetric memory (each rank's allocation
mapped into every other rank's address space over NVLink); a ``copy_`` from a peer's buffer is a
``cudaMemcpyAsync`` that a copy engine carries out, with no SMs taken from the compute kernels. On
CPU they are files in ``/dev/shm`` that every rank maps, so the CPU tests run the same code.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch
import torch.distributed as dist


class PeerMemory:
    """One byte buffer per rank of ``group``, each readable by every rank.

    Allocate it with ``allocate`` (a collective of the group); write ``local``, then call
    ``published`` (a collective) before any rank reads a peer's buffer.

    Attributes:
        local: This rank's buffer (``uint8``).
        peers: Every rank's buffer as this rank sees it, in group rank order (``peers[rank]`` is
            ``local``'s memory).
    """

    def __init__(self, local: torch.Tensor, peers: list[torch.Tensor], group: dist.ProcessGroup, keep=None):
        self.local = local
        self.peers = peers
        self.group = group
        self._keep = keep  # the symmetric memory handle, which owns the peers' mappings

    @classmethod
    def allocate(cls, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> PeerMemory:
        """Allocates ``nbytes`` on every rank of ``group`` and maps each rank's buffer on every rank.

        Raises:
            ValueError: The ranks of ``group`` are not all on this node.
        """
        hosts: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            raise ValueError(
                f"gather='peer' reads other ranks' memory, so a shard group must sit on one node; this one spans "
                f"{sorted(set(hosts))}: use gather='in_place'"
            )
        if device.type == "cuda":
            return cls._symmetric(nbytes, group, device)
        return cls._shared_files(nbytes, group)

    @classmethod
    def _symmetric(cls, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> PeerMemory:
        import torch.distributed._symmetric_memory as symm_mem  # torch's symmetric memory has no public module yet

        # Ray shows each rank only its own GPU, so every rank's is cuda:0; torch refuses that as two
        # ranks on one device unless told otherwise (which also leaves out multicast, unused here).
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(local, group.group_name)
        peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(handle.world_size)]
        peers[handle.rank] = local
        return cls(local, peers, group, keep=handle)

    @classmethod
    def _shared_files(cls, nbytes: int, group: dist.ProcessGroup) -> PeerMemory:
        token = [uuid.uuid4().hex]
        dist.broadcast_object_list(token, group_src=0, group=group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        paths = [f"/dev/shm/ray_hsdp-{token[0]}-{r}" for r in range(world)]
        local = torch.from_file(paths[rank], shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        dist.barrier(group=group)
        peers = [
            local
            if r == rank
            else torch.from_file(paths[r], shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
            for r in range(world)
        ]
        dist.barrier(group=group)
        os.unlink(paths[rank])  # every rank has mapped it: the mappings outlive the name, nothing leaks
        return cls(local, peers, group)

    def published(self) -> None:
        """Waits until every rank has written its buffer (a collective of the group)."""
        if self.local.is_cuda:
            torch.cuda.current_stream(self.local.device).synchronize()
        dist.barrier(group=self.group)
