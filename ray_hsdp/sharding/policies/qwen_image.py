"""Qwen-Image: its MMDiT, its Qwen2.5-VL text encoder, and how its pipeline takes guidance.

The pipeline guides with ``true_cfg_scale`` and a negative prompt (its ``guidance_scale`` is for
guidance-distilled checkpoints and does nothing here), and only when a negative prompt is given:
a guided request without one gets the model card's ``" "``.
"""

from ray_hsdp.sharding.pipeline_call import PipelineCall, register_pipeline_call
from ray_hsdp.sharding.policy import ShardingPolicy, register_policy


def _image_token_grid(pipe, module) -> tuple[int, int, int]:
    # One frame; latents are height / 8 by width / 8, packed in 2x2 patches.
    return 1, 1, pipe.vae_scale_factor * module.config.patch_size


def rotate_real(x, freqs_cis, use_real: bool = False, use_real_unbind_dim: int = -1):
    """diffusers' ``apply_rotary_emb_qwen`` with its complex product done in real arithmetic:
    ``(a + ib)(c + id) = (ac - bd) + i(ad + bc)`` on the interleaved pairs, in float32 as diffusers'.

    Why: inductor generates no code for complex operators, so in a compiled block diffusers' form
    runs as eager kernels (a float32 copy of q and k, the product, a cast) between the fused ones,
    and its compile takes twice as long (Qwen-Image's first compiled forward at 1328x1328 on an
    H200: 14.0 s, against 6.8 s; its forward within noise: ``bench/results/block-graph-qwen-image-*``).
    The same products and sums: equal to diffusers' in eager mode, up to the rounding of a fused
    multiply-add in a compiled one."""
    import torch

    if use_real or not torch.is_complex(freqs_cis):  # (Qwen-Image's processors call it with complex ones only)
        raise ValueError("rotate_real takes complex frequencies (use_real=False), as Qwen-Image's processors pass")
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)  # [B, S, H, D // 2]
    cos, sin = freqs_cis.real.unsqueeze(1), freqs_cis.imag.unsqueeze(1)  # [S, 1, D // 2]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(3).type_as(x)


def _rope_in_real_arithmetic() -> None:
    """diffusers' Qwen-Image processors apply ``rotate_real`` from here on. The module's global
    is replaced, for every Qwen-Image of the process: the processors look it up at each call, and
    an eager forward's result is unchanged by it."""
    from diffusers.models.transformers import transformer_qwenimage

    transformer_qwenimage.apply_rotary_emb_qwen = rotate_real


def _pad_text(kwargs: dict, degree: int) -> dict:
    """The text of a forward padded to a multiple of ``degree`` tokens, the padding masked out: the
    plan splits the text, whose length follows the prompt, over the sequence ranks. Masked keys add
    nothing to any query's attention, text positions only extend past the prompt's, and the text's
    outputs are dropped after the last block, so the image tokens come out as unpadded."""
    import torch

    text = kwargs.get("encoder_hidden_states")
    pad = -text.shape[1] % degree if text is not None and degree > 1 else 0
    if not pad:
        return kwargs
    mask = kwargs.get("encoder_hidden_states_mask")
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
    padded_text = torch.cat([text, text.new_zeros(text.shape[0], pad, text.shape[2])], dim=1)
    padded_mask = torch.cat([mask.bool(), mask.new_zeros(mask.shape[0], pad, dtype=torch.bool)], dim=1)
    return {**kwargs, "encoder_hidden_states": padded_text, "encoder_hidden_states_mask": padded_mask}


QWEN_IMAGE_TRANSFORMER = register_policy(
    "QwenImageTransformer2DModel",
    policy=ShardingPolicy(
        units=("transformer_blocks.*",),
        note="60 dual-stream blocks; the timestep and text embedders and the output layer stay in the root unit.",
        token_grid=_image_token_grid,
        # QwenImagePipeline: noise_pred = cond(...)[0]; if true CFG: neg_noise_pred = uncond(...)[0]; then both.
        cfg_split=True,
        split_inputs=_pad_text,
        traceable=_rope_in_real_arithmetic,
    ),
)

#: Qwen2.5-VL as a text encoder (Qwen-Image, HunyuanVideo-1.5): the language model's decoder
#: layers are the units (28 in the 7B); the vision tower stays whole on every rank (Qwen-Image's
#: text-to-image path never runs it), the embeddings, final norm and LM head in the root unit.
QWEN2_5_VL = register_policy(
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2_5_VLModel",
    "Qwen2_5_VLTextModel",
    policy=ShardingPolicy(
        units=("model.language_model.layers.*", "language_model.layers.*", "layers.*"),
        keep_replicated=("model.visual", "visual"),
        note="One unit per decoder layer of the language model; the vision tower whole.",
    ),
)

QWEN_IMAGE_CALL = register_pipeline_call(
    "QwenImagePipeline",
    call=PipelineCall(
        guidance="true_cfg_scale",
        negative_prompt_when_guided=" ",
        guided=lambda pipe, kwargs: kwargs.get("true_cfg_scale", 0) > 1 and kwargs.get("negative_prompt") is not None,
    ),
)
