"""How a pipeline class takes a request's choices, where it differs from the common diffusers call
(``guidance_scale``, ``negative_prompt``, ``image`` as a video's first frame).

diffusers' pipelines take no ``**kwargs`` but ignore what they do not read: Qwen-Image's
``guidance_scale`` does nothing (it guides with ``true_cfg_scale``), HunyuanVideo-1.5 takes no
guidance at all (its guider component holds it), FLUX.2's ``image`` is an optional reference, not a
first frame. A pipeline class registers here what it does; per-model entries live in
``ray_hsdp.sharding.policies``, and this module names no model class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: ``image`` roles: a first frame every request of an image-to-video pipeline brings, or an
#: optional reference image (an edit, a style) a request may bring.
FIRST_FRAME, REFERENCE = "first_frame", "reference"


def _cfg_flag(pipe, kwargs: dict) -> bool:
    # diffusers' own flag, which the pipeline sets from its guidance at the call's start.
    return bool(getattr(pipe, "do_classifier_free_guidance", False))


@dataclass(frozen=True)
class PipelineCall:
    """What a pipeline class does with a request's choices.

    Attributes:
        guidance: The call argument a request's ``guidance_scale`` becomes; ``None``: the pipeline
            takes none, and the request's guidance is set on its ``guider`` component
            (``guider.new(guidance_scale=...)``) for that call.
        negative_prompt_when_guided: The negative prompt of a guided request that sends none, for a
            pipeline that guides only with one (Qwen-Image: its model card's ``" "``); ``None``: the
            pipeline's own default.
        guided: ``guided(pipe, kwargs)``, during a call with ``kwargs``: whether each denoising step
            makes an unconditional forward after the conditional one (what CFG parallel splits).
        image: What the pipeline's ``image`` argument is (``FIRST_FRAME`` or ``REFERENCE``); for a
            class not registered, a first frame when the call takes one.
        cache_context: Whether the pipeline enters its transformer's ``cache_context`` around each
            forward: diffusers' step caches keep their state per context, so a pipeline that enters
            none runs no step cache (in diffusers either; refused at start, ``ray_hsdp.config.pairs``).
    """

    guidance: str | None = "guidance_scale"
    negative_prompt_when_guided: str | None = None
    guided: Callable[[object, dict], bool] = _cfg_flag
    image: str = FIRST_FRAME
    cache_context: bool = True


_CALLS: dict[str, PipelineCall] = {}


def register_pipeline_call(*class_names: str, call: PipelineCall) -> PipelineCall:
    """Registers ``call`` for the pipelines whose class is named one of ``class_names``."""
    for name in class_names:
        _CALLS[name] = call
    return call


def pipeline_call_for(pipe) -> PipelineCall:
    """The call registered for ``pipe``'s class (or a pipeline class; or its nearest registered
    base); the common one else."""
    for cls in (pipe if isinstance(pipe, type) else type(pipe)).__mro__:
        if cls.__name__ in _CALLS:
            return _CALLS[cls.__name__]
    return PipelineCall()
