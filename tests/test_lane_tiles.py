"""The VAE decode split over a lane (issue 25): each rank decodes some of the tiles of diffusers'
tiled decode and the leader blends them, so the frames equal the one-rank tiled decode; on lanes of
real groups (Ulysses, CFG x Ulysses, two lanes decoding at once) a request equals the unsharded
pipeline with the VAE's tiling on. And the row split (issue 40, ``vae_parallel: rows``): each rank
decodes a band of the picture's rows of the whole decode, equal to the untiled decode."""

from __future__ import annotations

import pytest
from gloo import GlooGroup
from support import max_abs_diff, reference_frames

from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.request import GenerationRequest


def shared_against_one_rank(mesh, rank, model: str, latent: tuple[int, ...], tiles: tuple[int, int] | None):
    """On every rank of a gloo group (one lane): the lane's decode of seeded latents, shared by
    tiles (``tiles``: tile and stride in pixels, against the VAE's own one-rank ``tiled_decode``)
    or, with ``None``, by bands of rows (against its whole decode); the leader returns its largest
    difference, the frames' shape and its exchanges with the other ranks, the other ranks ``None``."""
    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKLWan

    from ray_hsdp.pipeline.lane_tiles import LaneTiles
    from ray_hsdp.sharding.policy import decode_split_for

    vae = AutoencoderKLWan.from_pretrained(f"{model}/vae").eval()
    if tiles is not None:
        vae.enable_tiling(tiles[0], tiles[0], tiles[1], tiles[1])
    z = torch.randn((1, vae.config.z_dim, *latent), generator=torch.Generator().manual_seed(7))
    lane = LaneTiles(dist.group.WORLD, rank, dist.get_world_size(), "cpu")
    split = decode_split_for(vae)
    with torch.no_grad():
        shared = (split.decode if tiles is not None else split.rows)(vae, z, lane)
        if shared is None:
            return None
        one_rank = vae.tiled_decode(z).sample if tiles is not None else vae.decode(z).sample
    return float((shared - one_rank).abs().max()), tuple(shared.shape), lane.exchanges


@pytest.fixture(scope="module")
def lane_of_four(ray_cluster):
    """Four ranks of one gloo group: a lane that the decode tests below share."""
    with GlooGroup(4) as group:
        yield group


def test_a_lane_decodes_its_tiles_to_the_one_rank_tiled_decode(lane_of_four, tiny_model):
    """Tiles of 32 pixels every 24 (latent 4 every 3) over latents of 3 frames by 9 x 9: 3 x 3
    tiles, shared 3, 2, 2 and 2. (Below, lanes of 2 and 4 ranks decode at the VAE's own tile size.)"""
    latent = (3, 9, 9)
    results = lane_of_four.run(shared_against_one_rank, tiny_model, latent, (32, 24))
    assert results[1:] == [None] * 3  # only the leader holds the frames
    diff, shape, _ = results[0]
    assert diff <= 1e-5
    assert shape == (1, 3, 4 * (latent[0] - 1) + 1, 8 * latent[1], 8 * latent[2])


@pytest.mark.parametrize("latent", [(5, 7, 6), (3, 22, 4)])
def test_a_lane_decodes_bands_of_rows_to_the_whole_decode(lane_of_four, tiny_model, latent):
    """Bands of 1, 2, 2 and 2 latent rows (of 7), and of 5, 6, 5 and 6 (of 22): the convolutions'
    rows across a band's edge, the causal cache across frames and the middle block's attention
    over the whole picture all cross a band's edge. Each band carries rows of its neighbours' and
    exchanges only when convolutions have spent them: a few times per latent frame where bands are
    thick (the tiny decoder has 25 convolutions with a 3x3 kernel and an attention: an exchange
    before each would be 26)."""
    results = lane_of_four.run(shared_against_one_rank, tiny_model, latent, None)
    assert results[1:] == [None] * 3
    diff, shape, exchanges = results[0]
    assert diff <= 1e-5
    assert shape == (1, 3, 4 * (latent[0] - 1) + 1, 8 * latent[1], 8 * latent[2])
    if latent[1] >= 4 * 5:
        assert exchanges / latent[0] <= 6


#: 320 x 320 pixels: 2 x 2 of the Wan VAE's default tiles (256 every 192), in one request.
SPLIT = [
    GenerationRequest(prompt="a lighthouse", seed=3, num_inference_steps=2, width=320, height=320, num_frames=1),
    GenerationRequest(prompt="a red fox", seed=4, num_inference_steps=2, width=320, height=288, num_frames=1),
]


@pytest.fixture(scope="module")
def tiled_pipe(reference_pipe):
    reference_pipe.vae.enable_tiling()
    yield reference_pipe
    reference_pipe.vae.disable_tiling()


def test_two_lanes_split_their_decodes_at_once_and_equal_the_unsharded_tiled_run(ray_cluster, tiny_model, tiled_pipe):
    """Two lanes of Ulysses 2, two request slots per rank, four requests: the first two (2 steps)
    start at one tick, so the lanes' split decodes run at the same time, each on its lane's own
    process group. (The order of one lane's decodes: tests/runtime/test_contract.py; the CFG x
    Ulysses lane of four, 2 x 2 tiles: tests/test_image_to_video.py.) Then a decode that fails on a
    lane's follower fails the group at once, not at the collective timeout of its leader's gather."""
    import time

    import ray

    from ray_hsdp.group import GroupFailedError

    # 'on': lanes of two split only tiled decodes by default ('auto'; slower than whole otherwise).
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=4, ulysses_degree=2, requests_per_rank=2, vae_parallel="on"
    )
    requests = SPLIT + [
        GenerationRequest(prompt="a small boat", seed=5, num_inference_steps=1, width=320, height=320, num_frames=1),
        GenerationRequest(prompt="waves", seed=6, num_inference_steps=1, width=288, height=320, num_frames=1),
    ]
    with ShardGroup(config) as group:
        results = group.generate(requests)
        ray.get([group.ranks[follower].inject_fault.remote("decode") for follower in (1, 3)])
        failing = group.submit(SPLIT[0])
        injected_at = time.monotonic()
        with pytest.raises(GroupFailedError, match="split decode failed on rank [13]: injected fault"):
            failing.result(timeout=60)
        answered_s = time.monotonic() - injected_at
    for request, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(tiled_pipe, request)) <= 1e-5, request.prompt
    assert sorted(r.rank for r in results) == [0, 0, 2, 2]  # the leaders of the two lanes answered
    assert answered_s < 30  # the denoising, then the failure (the collective timeout is minutes)


def test_a_cfg_ulysses_lane_shares_its_decodes_by_rows_and_equals_the_unsharded_run(
    ray_cluster, tiny_model, reference_pipe
):
    """A CFG x Ulysses lane of four with ``vae_parallel: rows``: requests of several latent frames
    equal the unsharded pipeline (untiled); one too short for a row per rank decodes on the leader."""
    config = GroupConfig(
        model=tiny_model, device="cpu", shard_size=4, ulysses_degree=2, cfg_parallel=True, vae_parallel="rows"
    )
    requests = [
        GenerationRequest(prompt="a red fox", seed=4, num_inference_steps=2, width=64, height=80, num_frames=9),
        GenerationRequest(prompt="a lighthouse", seed=3, num_inference_steps=2, width=64, height=16, num_frames=5),
    ]
    with ShardGroup(config) as group:
        results = group.generate(requests)
    for request, result in zip(requests, results):
        assert max_abs_diff(result.frames, reference_frames(reference_pipe, request)) <= 1e-5, request.prompt
