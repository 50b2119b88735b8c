"""The fields of a request body that the image and the video schemas share (``schema``), declared
once in ``GenerationFields``: sizes, adapters, step caches, a scheduler's choices and vllm-omni's
``extra_params``, each checked as it is read, with the descriptions OpenAPI and the generated page
(``docs/requests.md``) show."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator

from ray_hsdp.request import SAMPLE_SOLVERS, check_sigmas, parse_lora, parse_size

MAX_SEED = 2**63 - 1


def size_is_wxh(value: str | None) -> str | None:
    if value is not None:
        parse_size(value)
    return value


#: ``"WxH"``, each side a multiple of 16 (checked by ``parse_size``).
Size = Annotated[str | None, AfterValidator(size_is_wxh)]


def _lora_is_valid(value):
    parse_lora(value)  # its ValueError names what is wrong
    return value


def _lora_form(value):
    """A form field carries an adapter object (vllm-omni's ``lora``) as JSON text."""
    if isinstance(value, str) and value.strip().startswith(("{", "[")):
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"lora is not valid JSON: {err}") from None
    return value


#: LoRA adapters: a name, ``"x:0.5,y"``, one ``{"name", "scale"}`` object, or a list of names and
#: such objects; lax even in the image body's strict model (``schema``), as it was: a Python caller's
#: tuple of names is a list.
Lora = Annotated[
    Annotated[str, Strict(False)] | Annotated[list[str | dict], Strict(False)] | dict | None,
    BeforeValidator(_lora_form),
    AfterValidator(_lora_is_valid),
]
LORA_DESCRIPTION = (
    "LoRA adapters of the deployment to run with (GET /v1/loras lists them): a name, 'name:scale,...', one "
    "{'name', 'scale'} object (vllm-omni's form), or a list of names and such objects; none when omitted."
)
TRUE_CFG_DESCRIPTION = (
    "vllm-omni's name of the guidance of a true-CFG pipeline (Qwen-Image): the same as guidance_scale, which "
    "this server passes as the pipeline's own guidance field; giving both, they must agree."
)


def guidance_of(body):
    """``guidance_scale``, or vllm-omni's ``true_cfg_scale`` (both: they must agree)."""
    if body.true_cfg_scale is not None and body.guidance_scale is not None:
        if float(body.true_cfg_scale) != float(body.guidance_scale):
            raise ValueError(
                f"guidance_scale={body.guidance_scale} and true_cfg_scale={body.true_cfg_scale} disagree: give one"
            )
    return body.guidance_scale if body.guidance_scale is not None else body.true_cfg_scale


def _cache_form(value):
    """A form field carries the cache's settings as a JSON object."""
    if isinstance(value, str) and value.strip().startswith("{"):
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"cache is not a JSON object: {err}") from None
    return value


#: A request's step cache: ``"on"``, ``"off"``, or an object of its settings.
#: (Its bool lax even in the image body's strict model, as it was: JSON's 1 or "true" is on.)
Cache = Annotated[Literal["on", "off"] | Annotated[bool, Strict(False)] | dict | None, BeforeValidator(_cache_form)]
CACHE_DESCRIPTION = (
    "Step cache (an approximation: faster, frames differ from the uncached run): 'on', 'off', or an object of "
    "settings (threshold for first_block; interval, warmup_steps, full_after_step for taylorseer); the "
    "deployment's choice when omitted (GET /v1/pool shows its cache)."
)


def _extra_params(value):
    """vllm-omni's ``extra_params``: a JSON object (a form field carries it as text) of the keys
    this server runs; an unknown key is refused by name, never ignored."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"extra_params is not a JSON object: {err}") from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"extra_params must be a JSON object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(EXTRA_PARAMS))
    if unknown:
        raise ValueError(
            f"extra_params.{unknown[0]} is not a parameter this server runs (it takes {list(EXTRA_PARAMS)})"
        )
    solver = value.get("sample_solver")
    if solver is not None and solver not in SAMPLE_SOLVERS:
        raise ValueError(f"extra_params.sample_solver must be one of {list(SAMPLE_SOLVERS)}, not {solver!r}")
    return value


#: The keys of ``extra_params`` a request may give, and what each does.
EXTRA_PARAMS = {"sample_solver": "the scheduler of the steps, as the request's sample_solver field"}
ExtraParams = Annotated[dict | None, BeforeValidator(_extra_params)]
EXTRA_PARAMS_DESCRIPTION = (
    "vllm-omni's model-specific parameters, a JSON object: sample_solver ('unipc' or 'euler'). Any other key is "
    "refused (HTTP 400, naming it)."
)
SOLVER_DESCRIPTION = (
    "The scheduler of the steps: 'unipc' (diffusers' UniPC multistep with flow sigmas, Wan's default) or 'euler' "
    "(diffusers' flow-match Euler, as step-distilled LoRAs run), each at flow_shift or the pipeline's shift; the "
    "deployment's sample_solver (or the pipeline's own scheduler) when omitted."
)
BOUNDARY_DESCRIPTION = (
    "Wan2.2 A14B: the fraction of the training timesteps below which the low-noise expert takes over from the "
    "high-noise one; the pipeline's own when omitted. A one-expert model refuses it."
)


def _sigmas_form(value):
    """A form field carries the sigmas as a JSON list; each value is checked (``check_sigmas``)."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"sigmas is not a JSON list: {err}") from None
    return list(check_sigmas(value)) if value is not None else None


Sigmas = Annotated[list[float] | None, BeforeValidator(_sigmas_form)]
SIGMAS_DESCRIPTION = (
    "The steps' sigmas before the scheduler's shift, one per step, falling in (0, 1] (a step-distilled model's "
    "schedule: [1.0, 0.75, 0.5, 0.25] is lightx2v's 4 steps at timesteps 1000/750/500/250); num_inference_steps is "
    "their count. Needs diffusers' flow-match Euler scheduler (the pipeline's, or sample_solver euler). An adapter's "
    "lora_defaults may give them."
)


def solver_of(body) -> str | None:
    """The request's solver from its field or its ``extra_params`` (both: they must agree)."""
    given = (body.extra_params or {}).get("sample_solver")
    if given is not None and body.sample_solver is not None and given != body.sample_solver:
        raise ValueError(
            f"sample_solver={body.sample_solver!r} and extra_params.sample_solver={given!r} disagree: give one"
        )
    return body.sample_solver or given


class GenerationFields(BaseModel):
    """The body fields of ``POST /v1/images/generations`` and ``POST /v1/videos`` alike: each
    declared here once; each route's model adds its own (``schema``)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(..., min_length=1, description="Text prompt.")
    model: str | None = Field(None, description="Served model name; the deployment's model when omitted.")
    size: Size = Field(None, description="'WxH', each a multiple of 16; the server default when omitted.")
    negative_prompt: str | None = Field(None, description="Negative prompt.")
    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(None, ge=0, description="Classifier-free guidance scale.")
    true_cfg_scale: float | None = Field(None, ge=0, description=TRUE_CFG_DESCRIPTION)
    guidance_scale_2: float | None = Field(
        None, ge=0, description="Guidance of the low-noise expert (Wan2.2 A14B); guidance_scale when omitted."
    )
    flow_shift: float | None = Field(
        None, gt=0, description="The scheduler's timestep shift (Wan's flow_shift); the pipeline's when omitted."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Noise seed; random when omitted.")
    user: str | None = Field(None, description="OpenAI's end-user id; accepted and ignored.")
    deadline_s: float | None = Field(
        None,
        gt=0,
        description="Target for the answer, in seconds from arrival: the group serves earliest targets first "
        "and, with adaptive lanes, picks a lane that makes it.",
    )
    lane_size: int | None = Field(
        None,
        ge=1,
        description="Ranks to run it on, in a group of adaptive lanes (lane_sizes); the group's choice when omitted.",
    )
    lora: Lora = Field(None, description=LORA_DESCRIPTION)
    cache: Cache = Field(None, description=CACHE_DESCRIPTION)
    boundary_ratio: float | None = Field(None, gt=0, lt=1, description=BOUNDARY_DESCRIPTION)
    sample_solver: Literal["unipc", "euler"] | None = Field(None, description=SOLVER_DESCRIPTION)
    sigmas: Sigmas = Field(None, description=SIGMAS_DESCRIPTION)
    extra_params: ExtraParams = Field(None, description=EXTRA_PARAMS_DESCRIPTION)

    @model_validator(mode="after")
    def _one_solver_and_guidance(self) -> GenerationFields:
        solver_of(self)
        guidance_of(self)
        return self

    def generation_fields(self) -> dict:
        """What a generation request takes of these fields, resolved (vllm-omni's names folded into
        ours) and without those left out: the image route's body of a video job (``schema``)."""
        given = self.model_dump(include=set(GenerationFields.model_fields) - SERVER_SIDE, exclude_none=True)
        resolved = {"guidance_scale": guidance_of(self), "sample_solver": solver_of(self)}
        return {**given, **{name: value for name, value in resolved.items() if value is not None}}


#: The fields a generation request does not carry: the routing's, and vllm-omni's other names of ours.
SERVER_SIDE = {"model", "user", "true_cfg_scale", "extra_params"}
