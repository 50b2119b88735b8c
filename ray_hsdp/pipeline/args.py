"""One request as a diffusers pipeline call: its keyword arguments, its guidance where the pipeline
keeps it on a guider, and the end of each denoising step, where a pipeline takes no step callback."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ray_hsdp.request import InvalidRequestError, RequestCancelledError
from ray_hsdp.sharding.pipeline_call import PipelineCall

#: Request choices a pipeline's call may not take: choice -> the call's arguments that take it.
CALL_ARGUMENTS = {"size": {"height", "width"}, "negative_prompt": {"negative_prompt"}}


def call_takes(params: set[str]) -> dict[str, bool]:
    """Which of the choices of ``CALL_ARGUMENTS`` a pipeline whose ``__call__`` takes ``params``
    takes (found once per pipeline class: its facts)."""
    return {choice: arguments <= params for choice, arguments in CALL_ARGUMENTS.items()}


def call_kwargs(call: PipelineCall, params: set[str], pipeline_name: str, variant) -> dict:
    """The keyword arguments of ``variant``'s request for a pipeline whose ``__call__`` takes
    ``params`` and whose class takes its choices as ``call`` says.

    Raises:
        InvalidRequestError: Frames or outputs per prompt the pipeline cannot make, or a choice the
            request gave that the call would drop (the table's request rows refuse those first).
    """
    request = variant.request
    given = {"negative_prompt": request.negative_prompt is not None, "size": request.size_given}
    dropped = [choice for choice, takes in call_takes(params).items() if given[choice] and not takes]
    if dropped:
        raise InvalidRequestError(f"{pipeline_name} takes no {' or '.join(dropped)}: leave it out of the request")
    negative = request.negative_prompt
    if negative is None and request.guidance_scale > 1:
        negative = call.negative_prompt_when_guided
    kwargs = {
        "prompt": request.prompt,
        "negative_prompt": negative,
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.num_inference_steps,
        "generator": torch.Generator("cpu").manual_seed(request.seed),
        # Frames stay on the device until ``frames.to_host``; a warm-up of the steps alone takes latents.
        "output_type": "pt" if request.decode else "latent",
    }
    if call.guidance is not None:  # else ``guidance_on`` sets it on the pipeline's guider
        kwargs[call.guidance] = request.guidance_scale
    kwargs.update(variant.pipeline_kwargs())  # its group checked them against this pipeline
    # Video pipelines take frames and "videos per prompt"; image pipelines take neither.
    if "num_frames" in params:
        kwargs["num_frames"] = request.num_frames
    elif request.num_frames != 1:
        raise InvalidRequestError(f"{pipeline_name} makes images; num_frames must be 1")
    per_prompt = next((k for k in ("num_videos_per_prompt", "num_images_per_prompt") if k in params), None)
    if per_prompt:
        kwargs[per_prompt] = request.n
    elif request.n != 1:
        raise InvalidRequestError(f"{pipeline_name} makes one output per prompt; n must be 1")
    return {k: v for k, v in kwargs.items() if k in params}


@contextmanager
def guidance_on(pipe, call: PipelineCall, guidance_scale: float) -> Iterator[None]:
    """The request's guidance on a copy of ``pipe``'s guider for its call, where the pipeline takes
    it nowhere else (``call.guidance`` None); the guider it had afterwards. ``pipe`` is the
    request's own slot of the pipeline, which runs one call at a time."""
    guider = getattr(pipe, "guider", None) if call.guidance is None else None
    if guider is None:
        yield
        return
    # A copy per call: the guider keeps the call's step as its state, and the slots of a rank would
    # share one (``guider.new`` would log diffusers' "experimental" warning at every request).
    own = copy.copy(guider)
    own.guidance_scale = guidance_scale
    # Plain attribute: DiffusionPipeline.__setattr__ would write the new guider into its config.
    object.__setattr__(pipe, "guider", own)
    try:
        yield
    finally:
        object.__setattr__(pipe, "guider", guider)


def step_end_callback(request, on_step: Callable[[int, int], bool], step_ends: list[float]) -> Callable[[int], None]:
    """``step_ended(step)`` after denoising step ``step`` (from 0): notes its time and asks
    ``on_step``, raising ``RequestCancelledError`` when it says stop (the pipeline then skips its
    decode, which diffusers' interrupt flag does not)."""
    total = request.num_inference_steps

    def step_ended(step: int) -> None:
        step_ends.append(time.perf_counter())
        if on_step(step + 1, total):
            raise RequestCancelledError(
                f"request {request.request_id!r} stopped after step {step + 1} of {total}, not decoded"
            )

    return step_ended


@contextmanager
def steps_watched(pipe, params: set[str], kwargs: dict, step_ended: Callable[[int], None] | None) -> Iterator[None]:
    """Calls ``step_ended`` at the end of each denoising step of ``pipe``'s call with ``kwargs``:
    through diffusers' ``callback_on_step_end`` where the pipeline takes it, else after each
    ``scheduler.step`` of the call (one per denoising step in diffusers' loops), on ``pipe``'s own
    scheduler (the request's slot: one call at a time)."""
    if step_ended is None:
        yield
        return
    if "callback_on_step_end" in params:

        def callback(pipe, step, timestep, callback_kwargs):
            step_ended(step)
            return callback_kwargs

        kwargs["callback_on_step_end"] = callback
        yield
        return
    scheduler = pipe.scheduler
    scheduler_step = scheduler.step
    done = [0]

    def step(*args, **step_kwargs):
        out = scheduler_step(*args, **step_kwargs)
        done[0] += 1
        step_ended(done[0] - 1)
        return out

    scheduler.step = step  # an instance attribute over the class's method, for this call
    try:
        yield
    finally:
        del scheduler.step
