"""Writer of the embedded default model: a tiny, seeded Wan text-to-video diffusers folder.

The folder is a normal diffusers pipeline (``model_index.json``, safetensors weights, a tokenizer),
so it is loaded through exactly the same code as a real checkpoint. It exists because our test
machines cannot reach a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A few sentences are enough: the tokenizer only has to cover the prompts of demos and tests
# with real sub-word pieces, so that different prompts give different token ids.
_CORPUS = [
    "A cat and a dog baking a cake together in a kitchen.",
    "A red fox runs through the snowy forest at dawn.",
    "An astronaut rides a horse on the surface of the moon.",
    "A small boat sails across a calm blue lake under the stars.",
    "Waves crash against the rocks while seagulls fly overhead.",
    "A robot paints a portrait of a woman in a sunny studio.",
    "The city skyline glows with neon lights on a rainy night.",
    "Bright tones, overexposed, static, blurred details, worst quality, low quality.",
    "a photo of an apple, a banana, a teapot and a green tree",
    "0 1 2 3 4 5 6 7 8 9 . , ! ? ' - : ;",
]

TINY_SEED = 0


def train_tokenizer(vocab_size: int = 160, model_max_length: int = 512):
    """A Unigram tokenizer trained on a few sentences, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    # T5-style: every sequence ends with </s>, as the UMT5 tokenizer of real Wan checkpoints does.
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


def build_tiny_wan(two_experts: bool = False):
    """Builds the tiny Wan pipeline in memory with seeded random weights.

    Args:
        two_experts: Also build ``transformer_2`` and set ``boundary_ratio``, as Wan2.2 A14B does.

    Returns:
        A ``diffusers.WanPipeline`` on the CPU in float32.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = train_tokenizer()
    torch.manual_seed(TINY_SEED)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=64,
            ffn_dim=64,
            num_layers=4,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    torch.manual_seed(TINY_SEED + 1)
    transformer_1 = transformer()
    transformer_2 = None
    if two_experts:
        torch.manual_seed(TINY_SEED + 2)
        transformer_2 = transformer()
    torch.manual_seed(TINY_SEED + 3)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer_1,
        transformer_2=transformer_2,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        boundary_ratio=0.5 if two_experts else None,
    )


def make_tiny(directory: str | Path, two_experts: bool = False, overwrite: bool = False) -> Path:
    """Writes the tiny Wan pipeline as a diffusers folder.

    Args:
        directory: Target folder; created if missing.
        two_experts: Write a two-expert (Wan2.2-style) pipeline.
        overwrite: Replace an existing pipeline in ``directory``.

    Returns:
        The folder, which ``DiffusionPipeline.from_pretrained`` loads.

    Raises:
        FileExistsError: The folder already holds a pipeline and ``overwrite`` is False.
    """
    path = Path(directory)
    if (path / "model_index.json").exists() and not overwrite:
        raise FileExistsError(f"{path} already holds a diffusers pipeline (pass overwrite=True to replace it)")
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_wan(two_experts=two_experts).save_pretrained(path, safe_serialization=True)
    return path


def is_pipeline_folder(directory: str | Path) -> bool:
    """True when ``directory`` holds a diffusers ``model_index.json`` that parses."""
    index = Path(directory) / "model_index.json"
    try:
        return isinstance(json.loads(index.read_text()), dict)
    except (OSError, ValueError):
        return False
