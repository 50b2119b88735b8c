"""Every policy on a tiny instance of its model class: FSDP units as intended, forward parity over 2 gloo ranks."""

import pytest
import torch
from gloo import GlooGroup
from torch.distributed.tensor import DTensor


def _flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4),
        encoder_hidden_states=torch.randn(1, 8, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([1.0]),
        img_ids=torch.randn(16, 3),
        txt_ids=torch.randn(8, 3),
    )
    return model, inputs


def _sd3():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8),
        encoder_hidden_states=torch.randn(1, 7, 32),
        pooled_projections=torch.randn(1, 64),
        timestep=torch.tensor([1.0]),
    )
    return model, inputs


def _hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=2,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    inputs = dict(
        hidden_states=torch.randn(1, 4, 1, 16, 16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 12, 16),
        encoder_attention_mask=torch.ones(1, 12),
        pooled_projections=torch.randn(1, 8),
        guidance=torch.tensor([1000.0]),
    )
    return model, inputs


def _qwen_image():
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16),
        encoder_hidden_states=torch.randn(1, 7, 16),
        encoder_hidden_states_mask=torch.ones(1, 7),
        timestep=torch.tensor([1.0]),
        img_shapes=[(1, 4, 4)],
    )
    return model, inputs


def _cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=8,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=8,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
    )
    inputs = dict(
        hidden_states=torch.randn(1, 1, 4, 8, 8),
        encoder_hidden_states=torch.randn(1, 8, 8),
        timestep=torch.tensor([500]),
    )
    return model, inputs


def _ltx_video():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=16,
    )
    inputs = dict(
        hidden_states=torch.randn(1, 32, 8),
        encoder_hidden_states=torch.randn(1, 16, 16),
        timestep=torch.tensor([500]),
        encoder_attention_mask=torch.ones(1, 16),
        num_frames=2,
        height=4,
        width=4,
    )
    return model, inputs


def _wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 16),
    )
    return model, inputs


def _t5(cls_name):
    def build():
        import transformers

        config_cls = transformers.UMT5Config if cls_name.startswith("UMT5") else transformers.T5Config
        config = config_cls(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
        )
        model = getattr(transformers, cls_name)(config)
        return model, dict(input_ids=torch.randint(0, 64, (2, 9)), attention_mask=torch.ones(2, 9, dtype=torch.long))

    return build


CASES = {
    "FluxTransformer2DModel": (
        _flux,
        {"transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"},
    ),
    "SD3Transformer2DModel": (_sd3, {"transformer_blocks.0", "transformer_blocks.1"}),
    "HunyuanVideoTransformer3DModel": (
        _hunyuan_video,
        {"transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"},
    ),
    "QwenImageTransformer2DModel": (_qwen_image, {"transformer_blocks.0", "transformer_blocks.1"}),
    "CogVideoXTransformer3DModel": (_cogvideox, {"transformer_blocks.0", "transformer_blocks.1"}),
    "LTXVideoTransformer3DModel": (_ltx_video, {"transformer_blocks.0", "transformer_blocks.1"}),
    "WanTransformer3DModel": (_wan, {"blocks.0", "blocks.1", "blocks.2"}),
    "UMT5EncoderModel": (_t5("UMT5EncoderModel"), {"encoder.block.0", "encoder.block.1", "encoder.block.2"}),
    "T5EncoderModel": (_t5("T5EncoderModel"), {"encoder.block.0", "encoder.block.1", "encoder.block.2"}),
}


def shard_and_compare(mesh, rank, case, gather, keep_gathered=0.0):
    """On each rank: the same seeded model and input, forward unsharded, shard, forward again."""
    from ray_hsdp.memory import unit_memory
    from ray_hsdp.sharding import resolve_plan, shard_module

    build, _ = CASES[case]
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()

    def output(m):
        out = m(**inputs, return_dict=False)[0] if "input_ids" not in inputs else m(**inputs).last_hidden_state
        return out.detach().clone()

    with torch.no_grad():
        reference = output(model)
    plan = resolve_plan(model, min_num_params=10**9)
    sharded = shard_module(
        model, plan, mesh, gather=gather, reshard_after_forward=True, forward_prefetch=1, keep_gathered=keep_gathered
    )
    sharded.activate()
    with torch.no_grad():
        sharded_output = output(model)
        again = output(model)  # the buffers taken in turn hold the right weights on every forward
    units = unit_memory(sharded.unit_modules)
    return {
        "class": plan.source,
        "units": {name for name in units if name != "<root>"},
        "units_hold_their_share": all(u["local"] * 2 <= u["full"] + 2 * 4096 for u in units.values()),
        "root_sharded": units["<root>"]["full"] > 0,
        "max_abs_diff": float((sharded_output - reference).abs().max()),
        "repeat_equal": bool(torch.equal(again, sharded_output)),
        "finite": bool(torch.isfinite(reference).all()),
        "whole_units": {
            name or "<root>"
            for name, m in sharded.unit_modules
            if not any(isinstance(p, DTensor) for p in m.parameters(recurse=not name))
        },
    }


@pytest.fixture(scope="module")
def gloo_pair(ray_cluster):
    with GlooGroup(2) as group:
        yield group


@pytest.mark.parametrize("gather", ["fsdp2", "in_place"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_units_and_forward_parity(gloo_pair, case, gather):
    _, expected_units = CASES[case]
    for result in gloo_pair.run(shard_and_compare, case, gather):
        assert result["class"] == f"policy for {case}"
        assert result["units"] == expected_units
        assert result["root_sharded"] and result["units_hold_their_share"], result
        assert result["repeat_equal"]
        assert result["finite"]
        assert result["max_abs_diff"] <= 1e-5, result


@pytest.mark.parametrize("gather", ["fsdp2", "in_place"])
@pytest.mark.parametrize(
    "keep, whole", [(0.5, {"blocks.0", "blocks.2"}), (1.0, {"blocks.0", "blocks.1", "blocks.2", "<root>"})]
)
def test_units_kept_gathered_are_whole_and_the_forward_unchanged(gloo_pair, gather, keep, whole):
    for result in gloo_pair.run(shard_and_compare, "WanTransformer3DModel", gather, keep):
        assert result["whole_units"] == whole
        assert result["repeat_equal"]
        assert result["max_abs_diff"] <= 1e-5, result
