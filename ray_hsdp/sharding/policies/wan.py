"""Wan2.1 / Wan2.2: the transformers (both experts of a two-expert pipeline use the same class) and
the split of the Wan VAE's tiled decode over a lane."""

import torch

from ray_hsdp.sharding.policy import DecodeSplit, ShardingPolicy, register_decode_split, register_policy


def _wan_token_grid(pipe, module) -> tuple[int, int, int]:
    # Latents are (frames - 1) / 4 + 1 by height / 8 by width / 8; patches are (1, 2, 2).
    p_t, p_h, _ = module.config.patch_size
    return pipe.vae_scale_factor_temporal, p_t, pipe.vae_scale_factor_spatial * p_h


WAN_TRANSFORMER = register_policy(
    "WanTransformer3DModel",
    policy=ShardingPolicy(
        units=("blocks.*",),
        note="Each WanTransformerBlock is one unit; embedders, output norm and projection stay in the root unit.",
        token_grid=_wan_token_grid,
        # WanPipeline: noise_pred = cond(...)[0]; if CFG: noise_uncond = uncond(...)[0]; then both.
        cfg_split=True,
    ),
)


def _wan_vae_tiled(vae, width: int, height: int) -> bool:
    # AutoencoderKLWan._decode tiles when the latents exceed one tile in either direction.
    ratio = vae.spatial_compression_ratio
    return width // ratio > vae.tile_sample_min_width // ratio or height // ratio > vae.tile_sample_min_height // ratio


def _wan_vae_tile(vae, z: torch.Tensor) -> torch.Tensor:
    """One spatial tile through the decoder, frame by frame with its causal cache, as
    ``AutoencoderKLWan.tiled_decode`` (diffusers 0.42) decodes each of its tiles."""
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
        t: _wan_vae_tile(vae, z[:, :, :, starts[t][0] : starts[t][0] + tile_h, starts[t][1] : starts[t][1] + tile_w])
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


WAN_VAE = register_decode_split(
    "AutoencoderKLWan", split=DecodeSplit(decode=_wan_vae_split_decode, tiled=_wan_vae_tiled)
)
