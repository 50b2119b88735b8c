"""Per-rank loading: shards equal the plain diffusers load, keys are accounted for, host memory stays low."""

import shutil
from pathlib import Path

import pytest
import torch
from gloo import GlooGroup
from safetensors.torch import load_file, save_file

from ray_hsdp.checkpoints.random_weights import make_random, write_random_model
from ray_hsdp.config.group import GroupConfig
from ray_hsdp.group import ShardGroup
from ray_hsdp.loading.components import CheckpointError, build_on_meta, fill_from_checkpoint, load_pipeline, materialize


def local_shards(mesh, rank, path, dtype):
    """On each rank: load with the sharded loader and return what this rank holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ray_hsdp.config.group import DEFAULT_SHARD_COMPONENTS
    from ray_hsdp.pipeline.sharded import LoadOptions, ShardedPipeline

    pipe = ShardedPipeline.load(
        Path(path),
        LoadOptions(
            dtype=dtype,
            device="cpu",
            rank=rank,
            mesh=mesh,
            shard_components=DEFAULT_SHARD_COMPONENTS,
            min_num_params=10**9,
            reshard_after_forward=True,
            forward_prefetch=1,
        ),
    )
    out = {}
    for name, module in pipe.modules.items():
        for pname, p in module.named_parameters():
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                out[f"{name}.{pname}"] = ("shard", offset[0], p.to_local().clone())
            else:
                out[f"{name}.{pname}"] = ("whole", 0, p.detach().clone())
    return out


# bfloat16 (the GPU dtype, with its fp32-kept parameters): float32 loads are every parity test's.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_sharded_load_equals_plain_diffusers_load(ray_cluster, tiny_model, dtype):
    plain = load_pipeline(Path(tiny_model), dtype)
    expected = {
        f"{name}.{pname}": p
        for name in ("transformer", "text_encoder", "vae")
        for pname, p in getattr(plain, name).named_parameters()
    }
    with GlooGroup(2) as group:
        ranks = group.run(local_shards, tiny_model, dtype)
    assert set(ranks[0]) == set(expected)
    kept_whole = set()
    for key, full in expected.items():
        pieces = [r[key] for r in ranks]
        kinds = {kind for kind, _, _ in pieces}
        assert len(kinds) == 1
        if kinds == {"whole"}:
            kept_whole.add(key)
            assert all(t.dtype == full.dtype and torch.equal(t, full) for _, _, t in pieces), key
            continue
        rows = sum(t.shape[0] for _, _, t in pieces)
        assert rows == full.shape[0], key
        for _, offset, t in pieces:
            assert t.dtype == full.dtype, (key, t.dtype, full.dtype)
            assert torch.equal(t, full[offset : offset + t.shape[0]]), key
    assert any(k.startswith("transformer.blocks.") for k in set(expected) - kept_whole)
    if dtype == "bfloat16":
        # diffusers keeps Wan's norms and modulation tables in float32: they stay whole (replicated).
        fp32 = {k for k, v in expected.items() if k.startswith("transformer.") and v.dtype == torch.float32}
        assert fp32 and fp32 <= kept_whole


def _filled_transformer(folder: Path):
    model = build_on_meta(folder, "diffusers", "WanTransformer3DModel", "float32")
    materialize(model, "cpu")
    return model, fill_from_checkpoint(model, folder)


def test_index_sharded_checkpoint_loads_like_plain(tmp_path):
    from diffusers import WanTransformer3DModel

    folder = Path(
        make_random("wan2.1-t2v-14b", tmp_path / "m", tiny=True, dtype="float32", shard_bytes=64 * 1024)["path"]
    )
    transformer = folder / "transformer"
    assert len(list(transformer.glob("*.safetensors"))) > 2
    model, stats = _filled_transformer(transformer)
    plain = WanTransformer3DModel.from_pretrained(transformer)
    assert stats["files"] > 2
    for (name, p), (_, q) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(p, q), name


def _copy_transformer(tiny_model, tmp_path) -> Path:
    folder = tmp_path / "transformer"
    shutil.copytree(Path(tiny_model) / "transformer", folder)
    return folder


def test_missing_key_is_an_error_that_names_it(tiny_model, tmp_path):
    folder = _copy_transformer(tiny_model, tmp_path)
    file = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(file)
    del state["blocks.1.ffn.net.0.proj.weight"]
    save_file(state, file)
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.1.ffn.net.0.proj.weight'\]"):
        _filled_transformer(folder)


def test_unexpected_key_and_wrong_shape_are_errors(tiny_model, tmp_path):
    folder = _copy_transformer(tiny_model, tmp_path)
    file = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(file)
    save_file({**state, "blocks.9.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(CheckpointError, match=r"unexpected keys \['blocks.9.extra.weight'\]"):
        _filled_transformer(folder)
    state["proj_out.bias"] = torch.zeros(3)
    save_file(state, file)
    with pytest.raises(CheckpointError, match="proj_out.bias: checkpoint shape"):
        _filled_transformer(folder)


def test_pickle_checkpoints_need_the_opt_in(tiny_model, tmp_path):
    folder = _copy_transformer(tiny_model, tmp_path)
    file = folder / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(file), folder / "diffusion_pytorch_model.bin")
    file.unlink()
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        _filled_transformer(folder)
    model = build_on_meta(folder, "diffusers", "WanTransformer3DModel", "float32")
    materialize(model, "cpu")
    assert fill_from_checkpoint(model, folder, allow_pickle=True)["files"] == 1


def test_a_rank_holds_about_its_share_of_host_memory_while_loading(ray_cluster, tiny_model, tmp_path):
    # A pipeline folder whose transformer is a few hundred MB (single file), the rest tiny.
    from diffusers import WanTransformer3DModel

    folder = tmp_path / "medium"
    shutil.copytree(tiny_model, folder)
    shutil.rmtree(folder / "transformer")
    kwargs = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=64,
        ffn_dim=4096,
        num_layers=6,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )
    size = write_random_model(WanTransformer3DModel, kwargs, folder / "transformer", torch.float32, 0, 2**40)
    assert 300e6 < size < 600e6
    group = ShardGroup(GroupConfig(model=str(folder), device="cpu", shard_size=2)).start()
    try:
        reports = group.memory()  # each rank's report carries its load figures
    finally:
        group.shutdown()
    for report in reports:
        print(f"rank {report['rank']}: peak RSS rise {report['load_peak_rss_bytes'] / size:.1%} of the checkpoint")
        assert report["load_bytes_read"] < 0.52 * size + 1e6
        assert report["load_peak_rss_bytes"] < 0.6 * size, (report["load_peak_rss_bytes"], size)
