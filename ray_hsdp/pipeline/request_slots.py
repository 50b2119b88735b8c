"""The request slots of a ``ShardedPipeline``: pipelines that run requests at the same time on one
rank, each with its own copies of the components that keep per-call state (``RequestSlots``), and
how a slot decodes: tiled or not, alone or split over the lane (``SlotDecodes``)."""

from __future__ import annotations

import copy
import functools
import queue

import torch

from ray_hsdp.memory import module_memory
from ray_hsdp.protocol import lane_of
from ray_hsdp.request import GenerationRequest, LaneCollectiveError, RequestCancelledError
from ray_hsdp.sharding.policy import decode_split_for
from ray_hsdp.variant import RequestVariant


class RequestSlots:
    """The pipelines a rank's requests run on, one request each at a time: the loaded one and
    ``count - 1`` copies (``fill``), and each slot's CUDA stream.

    Args:
        pipe: The loaded diffusers pipeline, the first slot.
        modules: Its ``nn.Module`` components by name (the real ones, also once proxies stand in).
        device: ``"cuda"`` or ``"cpu"``.
    """

    def __init__(self, pipe, modules: dict[str, torch.nn.Module], device: str):
        self.pipe = pipe
        self.modules = modules
        self.device = device
        #: Whether each slot runs its own work (scheduler, VAE) on a CUDA stream of its own, so that
        #: a decode overlaps the group's forwards instead of queueing before them.
        self.streams = False
        self._streams: dict[int, torch.cuda.Stream] = {}
        self.fill(1, ())

    def fill(self, count: int, shared: tuple[str, ...]) -> None:
        """Prepares ``count`` pipelines that can run requests at the same time on this rank.

        A diffusers pipeline keeps per-call state on itself, its scheduler, its tokenizers and
        its VAE (decode caches), so each concurrent request needs its own copies of those. The
        large modules named in ``shared`` (the shard components, sharded or not) are shared:
        their forwards keep no state, and sharded ones are serialised through the tick thread.
        The first slot is the loaded pipeline itself.
        """
        copies = []
        for _ in range(count - 1):
            clone = copy.copy(self.pipe)
            for name, component in self.pipe.components.items():
                if name not in shared and component is not None:
                    object.__setattr__(clone, name, copy.deepcopy(component))
            copies.append(clone)
        self.count = count
        #: The other slots' pipelines (the first slot is ``pipe``): their own VAE, scheduler, tokenizers.
        self.copies = copies
        self._free: queue.Queue = queue.Queue()
        for pipe in [self.pipe, *copies]:
            self._free.put(pipe)
        #: The bytes of the copies' own modules (replicated weights and buffers).
        self.copy_bytes = (count - 1) * sum(
            module_memory(m)["replicated"] + module_memory(m)["buffers"]
            for name, m in self.modules.items()
            if name not in shared
        )

    def take(self):
        """A free slot's pipeline, waiting for one; ``give_back`` returns it."""
        return self._free.get()

    def give_back(self, pipe) -> None:
        """Frees the slot of ``pipe`` for the next request."""
        self._free.put(pipe)

    def stream(self, pipe) -> torch.cuda.Stream | None:
        """The slot's own CUDA stream, or ``None`` (the current stream) when slots share it."""
        if self.device != "cuda" or not self.streams:
            return None
        if id(pipe) not in self._streams:
            self._streams[id(pipe)] = torch.cuda.Stream()
        return self._streams[id(pipe)]


class SlotDecodes:
    """How a request slot decodes: tiled or not (``tiling``), alone or shared over its lane
    (``parallel``, with this rank's side of its lanes' split decodes, ``lane_tiles``).

    Args:
        pipe: The loaded pipeline, whose VAE the choice reads (each slot's VAE is a copy of it).
        rank: This rank's index in its group, in a failed split decode's message.
    """

    def __init__(self, pipe, rank: int):
        self.pipe = pipe
        self.rank = rank
        #: ``("auto" | "on" | "off", pixels)``: when a request's decode uses the VAE's tiling.
        self.tiling: tuple[str, int] = ("off", 0)
        #: ``"auto" | "on" | "off" | "rows"``: when a lane shares a request's decode (with ``lane_tiles``).
        self.parallel = "off"
        #: Lane size -> this rank's side of its lane's split decodes on its lane of that size
        #: (``LaneTiles``); empty: no split.
        self.lane_tiles: dict[int, object] = {}

    def _lane_tiles_of(self, variant: RequestVariant):
        """This rank's side of the split decodes of the lane ``variant``'s ticket names (its fixed
        lane, or the adaptive lane it was given); ``None``: that lane does not split decodes."""
        if not self.lane_tiles or variant.ticket is None:
            return None
        return self.lane_tiles.get(lane_of(variant.ticket)[1])

    def share(self, variant: RequestVariant) -> str | None:
        """How the ranks of this rank's lane share the decode of ``variant``'s request: ``"rows"``
        (``parallel`` "rows", a VAE whose split has bands of rows, and a latent row or more
        per rank), ``"tiles"`` (a VAE whose tiled decode has a registered split, frames of more
        than one tile, and ``parallel`` "on", or "auto" where it measured faster than the
        leader alone: lanes of 4 or more, or a decode the leader would tile anyway), or ``None``:
        the leader decodes alone."""
        request, lane = variant.request, self._lane_tiles_of(variant)
        vae = getattr(self.pipe, "vae", None)
        split = decode_split_for(vae) if lane is not None and vae is not None else None
        if split is None:
            return None
        if self.parallel == "rows":
            banded = split.banded is not None and split.banded(vae, request.height, lane.size)
            return "rows" if banded else None
        if not split.tiled(vae, request.width, request.height):
            return None
        shares = self.parallel == "on" or lane.size >= 4 or self._tiles(request)
        return "tiles" if shares else None

    def _tiles(self, request: GenerationRequest) -> bool:
        """Whether ``tiling`` tiles the decode of ``request`` on a rank decoding alone."""
        mode, above_pixels = self.tiling
        return mode == "on" or (mode == "auto" and request.width * request.height > above_pixels)

    def set_tiling(self, pipe, variant: RequestVariant) -> None:
        """Tiles the slot's VAE decode for this request or not (each slot has a VAE of its own),
        and shares its tiles over the lane when the lane splits the decode."""
        vae = getattr(pipe, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            return
        # The instance attribute stands in for the class's tiled_decode: AutoencoderKL*._decode
        # calls self.tiled_decode when the frames exceed one tile.
        vars(vae).pop("tiled_decode", None)
        vars(vae).pop("_decode", None)
        share, lane = self.share(variant), self._lane_tiles_of(variant)
        if share == "rows":  # AutoencoderKL*.decode calls self._decode: the whole decode, by bands
            vae.disable_tiling()
            vae._decode = functools.partial(self._lane_decode, vae, lane, decode_split_for(vae).rows)
            return
        if share == "tiles":
            vae.enable_tiling()
            vae.tiled_decode = functools.partial(self._lane_decode, vae, lane, decode_split_for(vae).decode)
            return
        if self._tiles(variant.request):
            vae.enable_tiling()
        else:
            vae.disable_tiling()

    def _lane_decode(self, vae, lane, decode, z: torch.Tensor, return_dict: bool = True):
        """The slot VAE's ``tiled_decode`` (or ``_decode``) while its lane (``LaneTiles``) splits the
        decode (``decode(vae, z, lane)``: the split's tiles or rows): the leader returns what the VAE's
        own returns; another rank, once its share is handed over, ends its part of the request
        (``RequestCancelledError``, as at its last step without a split).

        Raises:
            LaneCollectiveError: The decode failed: the lane's other ranks may wait in its
                gather, so this rank's session must fail.
        """
        from diffusers.models.autoencoders.vae import DecoderOutput

        try:
            sample = lane.run(lambda: decode(vae, z, lane))
        except Exception as err:
            raise LaneCollectiveError(f"the lane's split decode failed on rank {self.rank}: {err}") from err
        if sample is None:
            raise RequestCancelledError(f"rank {self.rank} handed its share of the decode to its lane's leader")
        return DecoderOutput(sample=sample) if return_dict else (sample,)
