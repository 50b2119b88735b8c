"""Small stand-ins for pipelines whose text encoder is a chat language model (Qwen-Image's
Qwen2.5-VL, FLUX.2's Mistral 3, HunyuanVideo-1.5's Qwen2.5-VL): a tokenizer that knows the chat
template's special tokens, and the language model at a tiny width.

Those pipelines drop a fixed number of the template's leading tokens from the encoder's output
(Qwen-Image: 34, the system prompt; HunyuanVideo-1.5: 108), counted with the real tokenizer. The
stand-in tokenizer is a word-level one over Qwen2's byte-level pieces, which the real byte-level BPE
makes one token each of the templates' plain English words, so the system prompts come out as long
as with the real tokenizer: the writer checks the count, else the tiny model would drop part of the
prompt. Its vocabulary is every piece of a fixed corpus, sorted: the same ids in every process.
"""

from __future__ import annotations

import inspect

import torch

from ray_hsdp.checkpoints.standins import CORPUS, keep_variation, t5_encoder

#: Chat-template special tokens of the Qwen2 and Mistral tokenizers the pipelines format prompts with.
CHAT_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "<unk>",
    "<pad>",
)


#: The Qwen2 tokenizer's pre-tokenizing pattern (digits one by one, a punctuation mark joined to the
#: word after it, newlines apart): with it the templates' system prompts come out as many pieces as
#: the real byte-level BPE makes tokens of them (34 for Qwen-Image, 108 for HunyuanVideo-1.5).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Qwen2's chat template, as ``apply_chat_template`` renders HunyuanVideo-1.5's prompts.
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(templates: tuple[str, ...], pad_token: str, model_max_length: int = 4096):
    """A word-level tokenizer over Qwen2's byte-level pieces whose vocabulary covers ``templates``
    and the corpus of the other stand-ins; unknown pieces become ``<unk>``."""
    # Lazy: only the chat stand-ins need them (about 0.6 s per import at the top).
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    text = [t.replace("{}", " ") for t in templates] + list(CORPUS)
    for special in CHAT_SPECIALS:
        text = [t.replace(special, "\n") for t in text]
    pieces = sorted({piece for line in text for piece, _ in pre.pre_tokenize_str(line)})
    vocab = {token: i for i, token in enumerate(CHAT_SPECIALS)}
    vocab.update({piece: len(CHAT_SPECIALS) + i for i, piece in enumerate(pieces)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad_token,
        unk_token="<unk>",
        eos_token="<|im_end|>" if pad_token == "<|endoftext|>" else "</s>",
        additional_special_tokens=[s for s in CHAT_SPECIALS if s not in (pad_token, "<unk>")],
        model_max_length=model_max_length,
    )
    return tokenizer


def check_template_length(tokenizer, template: str, expected: int) -> None:
    """Fails unless the part of ``template`` before its ``{}`` is ``expected`` tokens long (what the
    pipeline drops from the encoder's output)."""
    prefix = template.split("{}")[0]
    count = len(tokenizer(prefix)["input_ids"])
    if count != expected:
        raise AssertionError(f"the stand-in tokenizer makes {count} tokens of the template's prefix, not {expected}")


def tiny_qwen2_5_vl_text(tokenizer, hidden_size: int, layers: int) -> dict:
    """The settings of a tiny Qwen2.5-VL language model ``hidden_size`` wide: two heads, its rotary
    sections (temporal, height, width) summing to half a head, as the real ones do."""
    heads = 2
    half = hidden_size // heads // 2
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
        },
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def qwen2_5_vl_encoder(tokenizer, hidden_size: int, layers: int = 2):
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` (a two-block vision tower beside the language
    model, as in the real one) whose last hidden state is ``hidden_size`` wide."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=tiny_qwen2_5_vl_text(tokenizer, hidden_size, layers),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            fullatt_block_indexes=[1],
            window_size=56,
        ),
        tie_word_embeddings=False,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


#: Qwen-Image's prompt template (``QwenImagePipeline.prompt_template_encode``) and the tokens of it
#: the pipeline drops (``prompt_template_encode_start_idx``).
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_DROPPED = 34

#: Standard deviation of a tiny chat encoder's weight matrices: at transformers' 0.02 a prompt moves
#: its 2-layer output too little to change a tiny image visibly.
TINY_ENCODER_STD = 0.15


def spread_weights(module, std: float = TINY_ENCODER_STD) -> None:
    """Redraws every weight matrix of ``module`` from N(0, std^2), from the global RNG (seeded by the writer)."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)


def qwen_image_standins(transformer_kwargs: dict) -> dict:
    """Qwen-Image: the chat tokenizer (its template's 34 dropped tokens checked), a tiny Qwen2.5-VL
    as wide as the transformer's ``joint_attention_dim``, a small Qwen-Image VAE (8x, 16 channels)
    and the pipeline's dynamic-shift flow-match scheduler."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    tokenizer = chat_tokenizer((QWEN_IMAGE_TEMPLATE,), pad_token="<|endoftext|>")
    check_template_length(tokenizer, QWEN_IMAGE_TEMPLATE, QWEN_IMAGE_DROPPED)
    text_encoder = qwen2_5_vl_encoder(tokenizer, transformer_kwargs["joint_attention_dim"])
    spread_weights(text_encoder)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.0] * 16, latents_std=[1.0] * 16
    )
    keep_variation(vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}


#: A Mistral chat template of the shape FLUX.2's prompts take (a system message, a user message,
#: each a list of text parts): the tiny tokenizer formats prompts as the real processor does.
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% set text = m['content'][0]['text'] if m['content'] is not string else m['content'] %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)

#: FLUX.2 reads the text encoder's hidden states after these layers (``text_encoder_out_layers``),
#: so even the tiny Mistral has as many layers as the last of them.
FLUX2_OUT_LAYERS = (10, 20, 30)


def mistral3_encoder(tokenizer, hidden_size: int, layers: int):
    """A tiny ``Mistral3ForConditionalGeneration`` (a one-layer Pixtral vision tower beside the
    language model, as in the real one) ``hidden_size`` wide with ``layers`` decoder layers."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            # Narrow inside: at FLUX.2-dev's width (5120) a stand-in of 30 layers stays small.
            intermediate_size=2 * min(hidden_size, 32),
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=2048,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=64,
            patch_size=16,
        ),
        tie_word_embeddings=False,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def flux2_standins(transformer_kwargs: dict) -> dict:
    """FLUX.2: the chat tokenizer with a Mistral template, a tiny Mistral 3 of ``FLUX2_OUT_LAYERS[-1]``
    layers whose three read layers make the transformer's ``joint_attention_dim``, a small FLUX.2 VAE
    (8x, 32 channels, 2x2 patches) and its flow-match scheduler."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tokenizer = chat_tokenizer((SYSTEM_MESSAGE,), pad_token="<pad>")
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    width = transformer_kwargs["joint_attention_dim"] // len(FLUX2_OUT_LAYERS)
    text_encoder = mistral3_encoder(tokenizer, width, FLUX2_OUT_LAYERS[-1])
    spread_weights(text_encoder)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=transformer_kwargs["in_channels"] // 4,
        norm_num_groups=4,
    )
    keep_variation(vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}


#: HunyuanVideo-1.5's system prompt and the tokens of its template the pipeline crops
#: (``prompt_template_encode_start_idx``).
HUNYUAN_VIDEO15_CROPPED = 108


def hunyuan_video15_template() -> str:
    """The prompt as HunyuanVideo-1.5's pipeline formats it (its system message, Qwen2's template)."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from diffusers import HunyuanVideo15Pipeline

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"


def qwen2_5_vl_text_model(tokenizer, hidden_size: int, layers: int = 2):
    """A tiny ``Qwen2_5_VLTextModel`` (HunyuanVideo-1.5 encodes text with Qwen2.5-VL's language model alone)."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**tiny_qwen2_5_vl_text(tokenizer, hidden_size, layers))).eval()


def hunyuan_video15_standins(transformer_kwargs: dict) -> dict:
    """HunyuanVideo-1.5: the chat tokenizer (its template's 108 cropped tokens checked) and a tiny
    Qwen2.5-VL text model of three layers (the pipeline reads the third-to-last hidden state), ByT5's
    byte tokenizer and a small T5 encoder for quoted glyph text, a small HunyuanVideo-1.5 VAE (16x
    spatial, 4x temporal, 32 channels), a flow-match scheduler and the CFG guider."""
    # Lazy: only this stand-in's classes (every stand-in's at the top: about 3 s per import).
    from diffusers import AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from transformers import ByT5Tokenizer

    template = hunyuan_video15_template()
    tokenizer = chat_tokenizer((template,), pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    check_template_length(tokenizer, template, HUNYUAN_VIDEO15_CROPPED)
    text_encoder = qwen2_5_vl_text_model(tokenizer, transformer_kwargs["text_embed_dim"], layers=3)
    spread_weights(text_encoder)
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = t5_encoder("T5EncoderModel", tokenizer_2, transformer_kwargs["text_embed_2_dim"])
    # The last block is as wide as the latents twice: the encoder folds its channels onto them.
    vae = AutoencoderKLHunyuanVideo15(block_out_channels=(8, 8, 16, 32, 64), layers_per_block=1, latent_channels=32)
    keep_variation(vae)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "tokenizer_2": tokenizer_2,
        "text_encoder_2": text_encoder_2,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
        "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }


#: Family -> stand-in writer, beside ``standins.STANDINS``.
CHAT_STANDINS = {
    "qwen_image": qwen_image_standins,
    "flux2": flux2_standins,
    "hunyuan_video15": hunyuan_video15_standins,
}
