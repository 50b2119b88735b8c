"""FLUX.2: its transformer, its Mistral 3 text encoder (24B in FLUX.2-dev: sharding it decides whether
the model fits a GPU at all), and how its pipeline takes a request's choices.

FLUX.2-dev is guidance-distilled: ``guidance_scale`` feeds a guidance embedding, and there is no
unconditional pass, so no negative prompt (its pipeline takes none: refused per request) and no
CFG parallel. Its ``image`` is an optional reference (an edit, a subject), not a first frame. Its
pipeline enters no cache context around its forwards, so no step cache runs on it (refused at start).
"""

from ray_hsdp.sharding.pipeline_call import REFERENCE, PipelineCall, register_pipeline_call
from ray_hsdp.sharding.policy import ShardingPolicy, register_policy


def _image_token_grid(pipe, module) -> tuple[int, int, int]:
    # One frame; latents are height / 8 by width / 8, packed in 2x2 patches.
    return 1, 1, pipe.vae_scale_factor * 2


FLUX2_TRANSFORMER = register_policy(
    "Flux2Transformer2DModel",
    policy=ShardingPolicy(
        units=("transformer_blocks.*", "single_transformer_blocks.*"),
        note="8 double-stream and 48 single-stream blocks in FLUX.2-dev; embedders and modulations in the root unit.",
        token_grid=_image_token_grid,
    ),
)

#: Mistral 3 as a text encoder: the language model's decoder layers are the units (40 in the 24B);
#: the Pixtral vision tower and its projector stay whole on every rank (a text prompt never runs
#: them), the embeddings, final norm and LM head in the root unit.
MISTRAL3 = register_policy(
    "Mistral3ForConditionalGeneration",
    policy=ShardingPolicy(
        units=("model.language_model.layers.*",),
        keep_replicated=("model.vision_tower", "model.multi_modal_projector"),
        note="One unit per decoder layer of the language model; the vision tower and projector whole.",
    ),
)

FLUX2_CALL = register_pipeline_call("Flux2Pipeline", call=PipelineCall(image=REFERENCE, cache_context=False))
