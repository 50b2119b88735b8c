"""A request's scheduler (``sample_solver``) and its step schedule (``sigmas``).

The scheduler: the request's pipeline slot runs its steps with
diffusers' UniPC multistep scheduler (flow sigmas, Wan's default) or its flow-match Euler
scheduler (what step-distilled LoRAs were trained with), each at the pipeline's shift (a
request's ``flow_shift`` then shifts it as it shifts the pipeline's own); the slot gets its own
scheduler back afterwards. A pipeline whose scheduler has no static shift refuses it (a pair of
the table of refusals, ``ray_hsdp.config.pairs``).

The schedule: a flow-match Euler scheduler sets the request's sigmas (before its shift) whatever
step count the pipeline asks it for: Wan's pipelines take no sigmas in their call, and a distilled
model's 4 steps are not the scheduler's own spacing of 4."""

from __future__ import annotations

from contextlib import nullcontext

from ray_hsdp.request import SAMPLE_SOLVERS, InvalidRequestError, check_sigmas
from ray_hsdp.variant.base import Feature, scheduler_for_the_run
from ray_hsdp.variant.shift import shift_key


def solver_scheduler(scheduler, solver: str):
    """A new scheduler of ``solver`` with ``scheduler``'s shift and training timesteps, as a
    diffusers user builds it: ``UniPCMultistepScheduler(prediction_type="flow_prediction",
    use_flow_sigmas=True, flow_shift=...)`` or ``FlowMatchEulerDiscreteScheduler(shift=...)``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    config = scheduler.config
    shift = float(config[shift_key(scheduler)])
    steps = int(config.get("num_train_timesteps", 1000))
    if solver == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=steps, shift=shift)
    return UniPCMultistepScheduler(
        num_train_timesteps=steps, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
    )


class SolverFeature(Feature):
    field = "sample_solver"

    def choose(self, request, config, facts):
        """The request's solver, else the group's (``sample_solver`` of its config)."""
        solver = request.sample_solver or getattr(config, "sample_solver", None)
        if solver is not None and solver not in SAMPLE_SOLVERS:
            raise InvalidRequestError(f"sample_solver must be one of {list(SAMPLE_SOLVERS)}, not {solver!r}")
        return solver

    def around_run(self, choice, pipe, features):
        if choice is None:
            return nullcontext()
        return scheduler_for_the_run(pipe, lambda own: solver_scheduler(own, choice))


class FixedSigmas:
    """A flow-match Euler scheduler that sets ``sigmas`` at every ``set_timesteps`` (the pipeline's
    step count is the schedule's length: the request's steps are ``len(sigmas)``); everything else
    is the scheduler's own."""

    def __init__(self, scheduler, sigmas: tuple[float, ...]):
        self._scheduler = scheduler
        self._sigmas = list(sigmas)

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, **kwargs):
        kwargs.pop("timesteps", None)
        return self._scheduler.set_timesteps(sigmas=self._sigmas, device=device, **kwargs)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


class SigmasFeature(Feature):
    field = "sigmas"

    def choose(self, request, config, facts):
        if request.sigmas is None:
            return None
        try:
            sigmas = check_sigmas(request.sigmas)
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
        if len(sigmas) != request.num_inference_steps:
            raise InvalidRequestError(
                f"sigmas has {len(sigmas)} values for num_inference_steps={request.num_inference_steps}: one per step"
            )
        return sigmas

    def around_run(self, choice, pipe, features):
        if choice is None:
            return nullcontext()
        return scheduler_for_the_run(pipe, lambda own: FixedSigmas(own, choice))
