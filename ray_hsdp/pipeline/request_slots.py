"""The request slots of a ``ShardedPipeline`` (whose state they use): each slot's own copies of the
components that keep per-call state, and how a slot decodes: tiled or not, alone or split over the
lane, on the slot's own CUDA stream or not."""

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
    """The request slots of ``ShardedPipeline``."""

    def splits_decode(self, variant: RequestVariant) -> bool:
        """Whether the ranks of this rank's lane share the decode of ``variant``'s request
        (``decode_share``); the same answer on every rank of the lane."""
        return self.decode_share(variant) is not None

    def _lane_tiles_of(self, variant: RequestVariant):
        """This rank's side of the split decodes of the lane ``variant``'s ticket names (its fixed
        lane, or the adaptive lane it was given); ``None``: that lane does not split decodes."""
        if not self.lane_tiles or variant.ticket is None:
            return None
        return self.lane_tiles.get(lane_of(variant.ticket)[1])

    def decode_share(self, variant: RequestVariant) -> str | None:
        """How the ranks of this rank's lane share the decode of ``variant``'s request: ``"rows"``
        (``vae_parallel`` "rows", a VAE whose split has bands of rows, and a latent row or more
        per rank), ``"tiles"`` (a VAE whose tiled decode has a registered split, frames of more
        than one tile, and ``vae_parallel`` "on", or "auto" where it measured faster than the
        leader alone: lanes of 4 or more, or a decode the leader would tile anyway), or ``None``:
        the leader decodes alone."""
        request, lane = variant.request, self._lane_tiles_of(variant)
        vae = getattr(self.pipe, "vae", None)
        split = decode_split_for(vae) if lane is not None and vae is not None else None
        if split is None:
            return None
        if self.vae_parallel == "rows":
            banded = split.banded is not None and split.banded(vae, request.height, lane.size)
            return "rows" if banded else None
        if not split.tiled(vae, request.width, request.height):
            return None
        shares = self.vae_parallel == "on" or lane.size >= 4 or self._tiles(request)
        return "tiles" if shares else None

    def _tiles(self, request: GenerationRequest) -> bool:
        """Whether ``vae_tiling`` tiles the decode of ``request`` on a rank decoding alone."""
        mode, above_pixels = self.vae_tiling
        return mode == "on" or (mode == "auto" and request.width * request.height > above_pixels)

    def _set_tiling(self, pipe, variant: RequestVariant) -> None:
        """Tiles the slot's VAE decode for this request or not (each slot has a VAE of its own),
        and shares its tiles over the lane when the lane splits the decode."""
        vae = getattr(pipe, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            return
        # The instance attribute stands in for the class's tiled_decode: AutoencoderKL*._decode
        # calls self.tiled_decode when the frames exceed one tile.
        vars(vae).pop("tiled_decode", None)
        vars(vae).pop("_decode", None)
        share, lane = self.decode_share(variant), self._lane_tiles_of(variant)
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

    def _slot_stream(self, pipe) -> torch.cuda.Stream | None:
        """The slot's own CUDA stream, or ``None`` (the current stream) when slots share it."""
        if self.device != "cuda" or not self.request_streams:
            return None
        if id(pipe) not in self._streams:
            self._streams[id(pipe)] = torch.cuda.Stream()
        return self._streams[id(pipe)]

    def vae_channels_last(self) -> int:
        """Puts the VAE's 3D convolution weights in channels-last memory (``torch.channels_last_3d``);
        call before ``set_request_slots``, whose copies keep the format. Returns how many."""
        vae = getattr(self.pipe, "vae", None)
        if not isinstance(vae, torch.nn.Module):
            return 0
        torch.nn.utils.convert_conv3d_weight_memory_format(vae, torch.channels_last_3d)
        return sum(isinstance(m, torch.nn.Conv3d) for m in vae.modules())

    def set_request_slots(self, slots: int, shared: tuple[str, ...]) -> None:
        """Prepares ``slots`` pipelines that can run requests at the same time on this rank.

        A diffusers pipeline keeps per-call state on itself, its scheduler, its tokenizers and
        its VAE (decode caches), so each concurrent request needs its own copies of those. The
        large modules named in ``shared`` (the shard components, sharded or not) are shared:
        their forwards keep no state, and sharded ones are serialised through the tick thread.
        The first slot is the loaded pipeline itself.
        """
        copies = []
        for _ in range(slots - 1):
            clone = copy.copy(self.pipe)
            for name, component in self.pipe.components.items():
                if name not in shared and component is not None:
                    object.__setattr__(clone, name, copy.deepcopy(component))
            copies.append(clone)
        self.request_slots = slots
        #: The other slots' pipelines (the first slot is ``pipe``): their own VAE, scheduler, tokenizers.
        self.slot_copies = copies
        self._slots: queue.Queue = queue.Queue()
        for pipe in [self.pipe, *copies]:
            self._slots.put(pipe)
        self.slot_copy_bytes = (slots - 1) * sum(
            module_memory(m)["replicated"] + module_memory(m)["buffers"]
            for name, m in self.modules.items()
            if name not in shared
        )
