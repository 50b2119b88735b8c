"""A lane's share of a decode: which tiles (or which band of rows) each rank decodes, the rows
its neighbours lend it, and the gather to the leader.

The ranks of a lane hold the same latents when their denoising ends, so each can decode a
disjoint share of a tiled decode's tiles (diffusers decodes every spatial tile on its own) and
the leader blends them all; or each can decode a band of the picture's rows of the whole
(untiled) decode, taking from its neighbours the rows a convolution reads across the band's edges
(``lend_rows``) and the whole picture's keys where the decoder attends over it (``all_rows``).

The collectives of these exchanges run on a gloo process group of the lane's ranks alone, created
for it and used by nothing else, from the request thread, while the tick thread goes on with the
group's forwards on the group's own communicator: gloo works on the host, so the exchange never
waits on a GPU kernel of the tick thread's NCCL collectives, nor they on it (two NCCL
communicators in use at once from two threads hung a lane of 4 H100s). On CUDA a lane's decode
runs on a stream of its own (see ``LaneTiles.run``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

#: Dims of a tile's shape sent ahead of the tiles (a decoded video tile has 5).
_MAX_DIMS = 7


def _host_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` flat in host memory as bytes: what the lane's gloo group sends (any dtype travels)."""
    return x.contiguous().cpu().reshape(-1).view(torch.uint8)


def _from_bytes(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bytes received for a tensor of ``like``'s dtype and shape, back as that, on ``like``'s device."""
    return buffer.view(like.dtype).view(like.shape).to(like.device)


class LaneTiles:
    """One rank's side of its lane's shared decodes (tiles or bands of rows).

    Args:
        group: The process group of the lane's ranks, for these exchanges only.
        index: This rank's place in its lane (0 leads and blends).
        size: Ranks in the lane.
        device: ``"cuda"`` or ``"cpu"``.
    """

    def __init__(self, group, index: int, size: int, device: str):
        self.group = group
        self.index = index
        self.size = size
        self.device = device
        self.stream = torch.cuda.Stream() if device == "cuda" else None
        self.exchanges = 0  # row exchanges (``lend_rows``, ``all_rows``) so far: what a row decode costs

    @property
    def leads(self) -> bool:
        return self.index == 0

    def share(self, count: int) -> list[int]:
        """The tiles (of ``count``, in the decode's row-major order) this rank decodes: every
        ``size``-th one, so that each rank gets edge and inner tiles alike."""
        return list(range(self.index, count, self.size))

    def band(self, rows: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of ``rows`` this rank decodes: ``rows`` split in order into
        bands as even as they go (a band of fewer rows than the lane has ranks is never asked:
        ``rows >= size``)."""
        return self.index * rows // self.size, (self.index + 1) * rows // self.size

    def lend_rows(self, top: torch.Tensor, bottom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends ``top`` (this rank's band's first rows) to the band above and ``bottom`` (its last
        rows, of ``top``'s shape) to the band below, and returns what they lend in turn: the band
        above's last rows and the band below's first rows (zeros at the picture's edges, where
        there is no band). Every rank of the lane calls it at the same point of a decode, with
        tensors of one shape."""
        self.exchanges += 1
        # One copy to the host for both edges and one back (each copy waits for the device).
        stacked = torch.stack([top, bottom])
        host = _host_bytes(stacked)
        half = host.numel() // 2
        received = torch.zeros_like(host)  # [from above, from below]
        sends = [(self.index - 1, host[:half], 0), (self.index + 1, host[half:], 1)]
        # The band above sent its bottom rows (tag 1), the band below its top rows (tag 0).
        receives = [(self.index - 1, received[:half], 1), (self.index + 1, received[half:], 0)]
        ops = [
            dist.P2POp(op, rows, self._peer(i), self.group, tag)
            for op, pairs in ((dist.isend, sends), (dist.irecv, receives))
            for i, rows, tag in pairs
            if 0 <= i < self.size
        ]
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        above, below = _from_bytes(received, stacked).unbind(0)
        return above, below

    def _peer(self, index: int) -> int:
        """The global rank of the lane's ``index``-th rank (point-to-point ops name global ranks)."""
        return dist.get_global_rank(self.group, index)

    def all_rows(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's band of ``x`` along ``dim``, in order: the whole picture's rows (bands may
        differ in rows by one; the other dims are alike on every rank)."""
        self.exchanges += 1
        counts = self._all_gather_host(torch.tensor([x.shape[dim]]))
        most = max(int(c) for c in counts)
        padded = torch.cat([x, x.new_zeros((*x.shape[:dim], most - x.shape[dim], *x.shape[dim + 1 :]))], dim)
        bands = self._all_gather_host(padded.contiguous())
        return torch.cat([band.narrow(dim, 0, int(c)) for band, c in zip(bands, counts)], dim)

    def _all_gather_host(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``all_gather`` of a tensor of one shape on every rank, over the lane's host (gloo)
        group, as bytes (any dtype travels); the results on ``x``'s device."""
        flat = _host_bytes(x)
        out = [torch.empty_like(flat) for _ in range(self.size)]
        dist.all_gather(out, flat, group=self.group)
        return [_from_bytes(o, x) for o in out]

    def run(self, decode: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """Runs ``decode`` (which decodes this rank's share and calls ``gather``) apart from the
        tick thread's work.

        On CUDA the decode stream first waits for the work queued so far on the current stream
        (the latents), and the caller waits on the host for the decode to end: the current
        stream, which the tick thread's forwards share, never waits on the lane's collectives, so
        a rank's forwards can never sit behind a gather that waits for a rank still in them.
        """
        if self.stream is None:
            return decode()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = decode()
        self.stream.synchronize()
        return out

    def gather(self, count: int, mine: dict[int, torch.Tensor], dtype: torch.dtype) -> dict[int, torch.Tensor] | None:
        """Hands this rank's decoded tiles to the lane's leader.

        Args:
            count: Tiles of the decode in all.
            mine: This rank's tiles by index (``share(count)``).
            dtype: The tiles' dtype (a rank with no tile sends padding of it).

        Returns:
            On the leader, every tile by index; ``None`` on the other ranks.
        """
        device = torch.device(self.device, torch.cuda.current_device()) if self.device == "cuda" else "cpu"
        # Shapes first (each rank fills the rows of its tiles), then one padded buffer per rank, in
        # host memory (the group is gloo's) and as bytes (any dtype travels).
        shapes = torch.zeros(count, _MAX_DIMS + 1, dtype=torch.int64)
        for i, tile in mine.items():
            shapes[i, 0] = tile.dim()
            shapes[i, 1 : tile.dim() + 1] = torch.tensor(tile.shape)
        dist.all_reduce(shapes, group=self.group)
        shapes = [tuple(row[1 : row[0] + 1]) for row in shapes.tolist()]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = [int(torch.Size(s).numel()) * itemsize for s in shapes]
        per_rank = [sum(nbytes[i] for i in range(r, count, self.size)) for r in range(self.size)]
        send = torch.zeros(max(per_rank), dtype=torch.uint8)
        if mine:
            send[: per_rank[self.index]] = _host_bytes(torch.cat([mine[i].reshape(-1).to(dtype) for i in sorted(mine)]))
        received = [torch.empty_like(send) for _ in range(self.size)] if self.leads else None
        dist.gather(send, received, group=self.group, group_dst=0)
        if not self.leads:
            return None
        tiles = {i: tile.to(dtype) for i, tile in mine.items()}  # the leader's own never left it
        for r, buffer in enumerate(received[1:], start=1):
            if not per_rank[r]:
                continue
            buffer = buffer[: per_rank[r]].to(device).view(dtype)
            offset = 0
            for i in range(r, count, self.size):
                numel = nbytes[i] // itemsize
                tiles[i] = buffer[offset : offset + numel].view(shapes[i])
                offset += numel
        return tiles
