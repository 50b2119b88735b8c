"""The Wan VAE's decode shared over a lane, two ways.

**Tiles**: diffusers' tiled decode with its tiles shared out; the leader blends them as the
one-rank tiled decode does (equal to it).

**Rows**: the whole (untiled) decode with the picture's rows cut into one band per rank. Every
kind of layer of the Wan2.1 decoder but two works on each pixel alone (the RMS norms normalise over
channels, the upsamplers repeat pixels, the 1x1 convolutions and the causal cache work per pixel
and frame): the convolutions with a 3x3 spatial kernel read one row across a band's edge, and the middle
block's attention, over each frame's whole picture, takes every band's keys and values
(``LaneTiles.all_rows``) for its own rows' queries. A band is carried with rows of its neighbours'
on each side (``_Band``): each such convolution spends one of them, and when they are spent the
neighbours lend them again (``LaneTiles.lend_rows``). So each rank computes its rows exactly as the
whole decode does, with about a quarter of the work on a lane of four, and the leader stacks the
bands.
"""

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ray_hsdp.sharding.policy import DecodeSplit, register_decode_split


def _wan_vae_tiled(vae, width: int, height: int) -> bool:
    # AutoencoderKLWan._decode tiles when the latents exceed one tile in either direction.
    ratio = vae.spatial_compression_ratio
    return width // ratio > vae.tile_sample_min_width // ratio or height // ratio > vae.tile_sample_min_height // ratio


def _wan_vae_frames(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents ``z`` (one spatial tile, or one band of rows) through the decoder, frame by frame
    with its causal cache, as ``AutoencoderKLWan.tiled_decode`` (diffusers 0.42) decodes each of its
    tiles (``_decode`` runs the 1x1x1 ``post_quant_conv`` on every frame at once: the same values)."""
    vae.clear_cache()
    frames = []
    for k in range(z.shape[2]):
        vae._conv_idx = [0]
        tile = vae.post_quant_conv(z[:, :, k : k + 1])
        frames.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def _wan_vae_split_decode(vae, z: torch.Tensor, lane) -> torch.Tensor | None:
    """``AutoencoderKLWan.tiled_decode`` with its tiles shared over the lane: the same tile grid,
    sizes and overlaps; the leader blends with the VAE's own ``blend_v`` / ``blend_h``, crops,
    unpatchifies and clamps as it does. The parity tests hold it to the one-rank tiled decode."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    _, _, _, height, width = z.shape
    ratio = vae.spatial_compression_ratio
    tile_h, tile_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    sample_h, sample_w = height * ratio, width * ratio
    out_h, out_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    patch = vae.config.patch_size
    if patch is not None:
        sample_h, sample_w, out_h, out_w = sample_h // patch, sample_w // patch, out_h // patch, out_w // patch
        blend_h, blend_w = vae.tile_sample_min_height // patch - out_h, vae.tile_sample_min_width // patch - out_w
    else:
        blend_h, blend_w = vae.tile_sample_min_height - out_h, vae.tile_sample_min_width - out_w
    starts = [(i, j) for i in range(0, height, stride_h) for j in range(0, width, stride_w)]
    columns = len(range(0, width, stride_w))
    mine = {
        t: _wan_vae_frames(vae, z[:, :, :, starts[t][0] : starts[t][0] + tile_h, starts[t][1] : starts[t][1] + tile_w])
        for t in lane.share(len(starts))
    }
    tiles = lane.gather(len(starts), mine, vae.dtype)
    if tiles is None:
        return None
    rows = [[tiles[r * columns + c] for c in range(columns)] for r in range(len(starts) // columns)]
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend_h)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_w)
            result_row.append(tile[:, :, :, :out_h, :out_w])
        result_rows.append(torch.cat(result_row, dim=-1))
    dec = torch.cat(result_rows, dim=3)[:, :, :, :sample_h, :sample_w]
    if patch is not None:
        dec = unpatchify(dec, patch_size=patch)
    return torch.clamp(dec, min=-1.0, max=1.0)


def _wan_vae_banded(vae, height: int, ranks: int) -> bool:
    """Whether the row split applies: a Wan2.1 VAE (no patchified output, no residual upsampling:
    the Wan2.2 5B VAE's layers are not checked here) and a latent row or more per rank."""
    plain = vae.config.patch_size is None and not getattr(vae.config, "is_residual", False)
    return plain and height // vae.spatial_compression_ratio >= ranks


#: Rows a band carries beyond its own on each side at the latents' scale, taken from the whole
#: latents (every rank of the lane holds them: no exchange) ...
_LATENT_EXTENSION = 12
#: ... and at each scale after an upsampling, lent by the neighbouring bands when spent. Each
#: convolution with a 3x3 spatial kernel spends one row of it on each side, so a band exchanges
#: rows about once per this many convolutions instead of before each one (every exchange drains
#: the device and goes through the host), for this many rows more work on each side. 12: at 720p on
#: 4 H200s, 2 exchanges per latent frame and 2.29 s against 3.47 s at 6 (5 exchanges) and 3.78 s
#: for the whole decode on one GPU (``bench/results/decode-wan2.1-vae-rows-carried-cl-4xH200.md``).
_EXTENSION = 12


class _Band:
    """One rank's band of the picture's rows on its way through the decoder, at the scale the
    decoder has reached: its rows ``[start, stop)`` of ``height``, carried with ``ext`` rows more
    on each side, of which the ``valid`` nearest the band hold what the whole decode holds there
    (the rest are spent by convolutions; rows outside the picture are read as the convolutions'
    zero padding). Every rank of the lane goes through the same ``ext``, ``valid`` and
    ``thinnest``, so they exchange at the same points."""

    def __init__(self, lane, rows: int):
        self.lane = lane
        self.latent = (*lane.band(rows), rows)
        self.restart()

    def extend(self, z: torch.Tensor) -> torch.Tensor:
        """This band of the latents ``z`` (rows in dim 3) with ``ext`` rows of ``z`` on each side,
        zeros beyond the picture."""
        top, bottom = max(0, self.start - self.ext), min(self.height, self.stop + self.ext)
        band = z[:, :, :, top:bottom]
        return F.pad(band, (0, 0, self.ext - (self.start - top), self.ext - (bottom - self.stop)))

    def restart(self) -> None:
        """At the latents' scale, its carried rows all valid: the decoder starts a frame."""
        self.start, self.stop, self.height = self.latent
        self.thinnest = self.height // self.lane.size  # the lane's thinnest band (``LaneTiles.band``)
        self.ext = self.valid = _LATENT_EXTENSION

    def own(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The band's own rows of ``x``."""
        return x.narrow(dim, self.ext, self.stop - self.start)

    def refresh(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with the rows nearest the band on each side lent again by the neighbouring bands
        (as many as the thinnest band has, up to ``ext``): they become valid."""
        lent, rows = min(self.ext, self.thinnest), self.stop - self.start
        above, below = self.lane.lend_rows(x.narrow(dim, self.ext, lent), x.narrow(dim, self.ext + rows - lent, lent))
        outer = self.ext - lent
        x = torch.cat(
            [x.narrow(dim, 0, outer), above, self.own(x, dim), below, x.narrow(dim, self.ext + rows + lent, outer)], dim
        )
        self.valid = lent
        return x

    def padded(self, x: torch.Tensor, dim: int, width: int, others: tuple[int, ...]) -> torch.Tensor:
        """``x`` for a convolution that reads ``width`` rows across each side (lending rows first if
        fewer are valid): rows outside the picture as zeros, and ``width`` zero rows more on each
        side (``F.pad``'s ``others``, the dims after ``dim`` first, and the dims before it). The
        convolution spends ``width`` valid rows."""
        if self.valid < width:
            x = self.refresh(x, dim)
        above = max(0, self.ext - self.start)  # rows of the extension above the picture's first
        below = max(0, self.stop + self.ext - self.height)
        x = x.narrow(dim, above, x.shape[dim] - above - below)
        self.valid -= width
        return F.pad(x, (*others[:2], above + width, below + width, *others[2:]))

    def upsampled(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` after a nearest 2x upsampling of the rows: the band at the new scale, its extension
        cut back to at most ``_EXTENSION`` rows (the outer ones go)."""
        self.start, self.stop, self.height = 2 * self.start, 2 * self.stop, 2 * self.height
        self.thinnest *= 2
        ext = min(2 * self.ext, _EXTENSION)
        x = x.narrow(dim, 2 * self.ext - ext, self.stop - self.start + 2 * ext)
        self.ext, self.valid = ext, min(2 * self.valid, ext)
        return x


def _band_causal_conv(conv, band: _Band, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``WanCausalConv3d.forward`` (diffusers 0.42) on a band: the causal cache and the time and
    width padding as there, the rows across the band's edges from its extension (lent again with
    the cached frames' when spent: their rows are spent alike)."""
    padding = list(conv._padding)  # (left, right, top, bottom, front, back)
    if cache_x is not None and conv._padding[4] > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        padding[4] -= cache_x.shape[2]
    x = band.padded(x, 3, padding[2], (padding[0], padding[1], padding[4], padding[5]))
    return nn.Conv3d.forward(conv, x)


def _band_conv2d(conv: nn.Conv2d, band: _Band, x: torch.Tensor) -> torch.Tensor:
    """An upsampler's 3x3 ``Conv2d`` (zero padding 1) on a band of frames ``(b * t, c, h, w)``,
    right after the nearest 2x upsampling: the band moves to the new scale first."""
    pad_h, pad_w = conv.padding
    x = band.padded(band.upsampled(x, 2), 2, pad_h, (pad_w, pad_w))
    return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def _band_residual(block, band: _Band, x: torch.Tensor, feat_cache=None, feat_idx=(0,)) -> torch.Tensor:
    """``WanResidualBlock.forward`` on a band, its rows lent first when its two convolutions would
    spend more than are valid (so its shortcut holds them too); after it, the valid rows are the
    fewer of its two paths'."""
    needed = block.conv1._padding[2] + block.conv2._padding[2]
    if band.valid < needed:
        x = band.refresh(x, 3)
    entering = band.valid
    out = type(block).forward(block, x, feat_cache=feat_cache, feat_idx=feat_idx)
    band.valid = min(band.valid, entering)
    return out


def _band_attention(block, band: _Band, x: torch.Tensor) -> torch.Tensor:
    """``WanAttentionBlock.forward`` (diffusers 0.42) for the queries of a band's rows (and its
    extension's) over the whole picture's keys and values (one head; tokens in row-major order,
    as there): every band's own rows' keys and values, gathered."""
    identity = x
    batch, channels, time, height, width = x.size()
    x = block.norm(x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width))
    q, k, v = block.to_qkv(x).chunk(3, dim=1)
    kv = band.lane.all_rows(band.own(torch.cat([k, v], dim=1), 2), 2)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # (b * t, c, h, w) -> (b * t, 1, h * w, c)
        return t.flatten(2).transpose(1, 2).unsqueeze(1).contiguous()

    k, v = kv.chunk(2, dim=1)
    x = F.scaled_dot_product_attention(tokens(q), tokens(k), tokens(v))
    x = block.proj(x.squeeze(1).permute(0, 2, 1).reshape(batch * time, channels, height, width))
    return x.view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4) + identity


def _band_decoder(decoder, band: _Band, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``WanDecoder3d.forward`` for one latent frame of the band: it starts at the latents' scale."""
    band.restart()
    return type(decoder).forward(decoder, x, *args, **kwargs)


@contextmanager
def _banded(decoder: nn.Module, band: _Band):
    """The decoder's layers that read across rows, on bands while in the context (instance
    ``forward``s, removed after: each request slot has a VAE of its own)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanResidualBlock,
    )

    patched = [decoder]
    decoder.forward = functools.partial(_band_decoder, decoder, band)
    for module in decoder.modules():
        if isinstance(module, WanCausalConv3d) and module._padding[2] > 0:
            module.forward = functools.partial(_band_causal_conv, module, band)
        elif isinstance(module, WanResidualBlock):
            module.forward = functools.partial(_band_residual, module, band)
        elif isinstance(module, WanAttentionBlock):
            module.forward = functools.partial(_band_attention, module, band)
        elif isinstance(module, WanResample) and module.mode.startswith("upsample"):
            module = next(m for m in module.resample.modules() if isinstance(m, nn.Conv2d))
            module.forward = functools.partial(_band_conv2d, module, band)
        else:
            continue
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _wan_vae_row_decode(vae, z: torch.Tensor, lane) -> torch.Tensor | None:
    """``AutoencoderKLWan._decode`` (untiled) of this rank's band of ``z``'s rows, carried with
    rows of the neighbouring bands (``_Band``); the leader stacks every band's own rows and clamps
    as it does. Returns the sample on the leader, ``None`` elsewhere."""
    band = _Band(lane, z.shape[3])
    with _banded(vae.decoder, band):
        decoded = band.own(_wan_vae_frames(vae, band.extend(z)), 3)
    bands = lane.gather(lane.size, {lane.index: decoded}, vae.dtype)
    if bands is None:
        return None
    return torch.clamp(torch.cat([bands[r] for r in range(lane.size)], dim=3), min=-1.0, max=1.0)


WAN_VAE = register_decode_split(
    "AutoencoderKLWan",
    split=DecodeSplit(
        decode=_wan_vae_split_decode, tiled=_wan_vae_tiled, rows=_wan_vae_row_decode, banded=_wan_vae_banded
    ),
)
