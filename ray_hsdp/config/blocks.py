"""The nested blocks of a configuration (``config.group``, ``config.app``): a group's step cache
(``cache``), an adapter's request defaults (``lora_defaults.<adapter>``) and the application's
autoscaling (``autoscaling``), each a model of its own that validates its fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ray_hsdp.request import StepCache, check_sigmas

#: The fields of a step cache a request may set for itself (``StepCache``'s, but ``kind``).
CACHE_REQUEST_FIELDS = ("threshold", "interval", "warmup_steps", "full_after_step")


class StepCacheConfig(BaseModel):
    """A group's step cache: the hooks its ranks load, and the settings a request gets.

    An approximation a user turns on: a cached request's frames differ from the uncached run's.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "first_block", "taylorseer"] = Field(
        "none",
        description="'first_block': diffusers' First Block Cache (a step reuses the last residual of the blocks "
        "after the first when the first block's output barely changed); 'taylorseer': a schedule of full steps "
        "and steps predicted from them (diffusers' TaylorSeer); 'none': every step computed in full.",
    )
    every_request: bool = Field(
        True,
        description="Requests that do not say (their 'cache' field) run with the cache; False: only those that "
        "ask ('cache': 'on' or an object of settings).",
    )
    threshold: float = Field(
        0.05,
        ge=0,
        description="first_block: the relative change of the first block's residual below which a step "
        "reuses the cache (diffusers' default 0.05; higher: faster, further from the uncached frames).",
    )
    interval: int = Field(
        2,
        ge=1,
        description="taylorseer: one full step in every 'interval' after the warm-up (2: about half the forwards).",
    )
    warmup_steps: int = Field(1, ge=1, description="taylorseer: steps computed in full first.")
    full_after_step: int | None = Field(
        None, ge=1, description="taylorseer: steps from this index on are computed in full; None: none."
    )
    max_order: int = Field(1, ge=1, le=4, description="taylorseer: the order of the Taylor expansion (loaded once).")
    lite: bool = Field(
        True,
        description="taylorseer: predict only the output projection and skip every block on a predicted step "
        "(a few MB of state per request); False: predict each attention's output and run the rest (GBs of state "
        "per request for a video).",
    )

    def settings(self, **overrides) -> StepCache:
        """This config's settings for one request, with the fields it gives (``CACHE_REQUEST_FIELDS``)."""
        fields = {name: getattr(self, name) for name in CACHE_REQUEST_FIELDS}
        return StepCache(kind=self.kind, **{**fields, **overrides})

    def resolve(self, value) -> StepCache | None:
        """The step cache of a request whose ``cache`` field is ``value``.

        Forms: ``None`` (the group's choice, ``every_request``), ``"on"`` / ``"off"`` (also
        ``True`` / ``False``), or an object of settings (``CACHE_REQUEST_FIELDS``, and ``kind``,
        which must be the group's).

        Raises:
            ValueError: The group has no step cache and the request asks for one, another kind,
                an unknown field, or a value out of range.
        """
        if value is None:
            return self.settings() if self.kind != "none" and self.every_request else None
        if value in ("off", False):
            return None
        if self.kind == "none":
            raise ValueError(
                "this deployment has no step cache (its cache kind is 'none'); send cache 'off' or omit it"
            )
        if value in ("on", True):
            return self.settings()
        if not isinstance(value, dict):
            raise ValueError(
                f"cache must be 'on', 'off' or an object of {', '.join(CACHE_REQUEST_FIELDS)}; got {value!r}"
            )
        given = dict(value)
        kind = given.pop("kind", self.kind)
        if kind != self.kind:
            raise ValueError(f"cache kind {kind!r}: this deployment loads the {self.kind!r} step cache only")
        unknown = sorted(set(given) - set(CACHE_REQUEST_FIELDS))
        if unknown:
            raise ValueError(f"cache: unknown field(s) {unknown}; a request may set {', '.join(CACHE_REQUEST_FIELDS)}")
        try:
            merged = StepCacheConfig(**{**self.model_dump(), **given})  # the same checks as the config's
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"cache.{where}: {first['msg']} (got {first['input']!r})") from None
        return merged.settings()


class LoraDefaults(BaseModel):
    """What a request that names an adapter gets for the fields it leaves out (a step-distillation
    LoRA: 4 steps, no guidance). Unset fields fall back to the app's defaults."""

    model_config = ConfigDict(extra="forbid")

    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(None, ge=0, description="Guidance scale (1 or below: no unconditional pass).")
    guidance_scale_2: float | None = Field(
        None, ge=0, description="The low-noise expert's guidance of a two-expert pipeline (Wan2.2 A14B)."
    )
    flow_shift: float | None = Field(
        None, gt=0, description="The scheduler's timestep shift (Wan's flow_shift) the adapter was distilled with."
    )
    boundary_ratio: float | None = Field(
        None, gt=0, lt=1, description="Wan2.2 A14B: where the low-noise expert takes over, as the adapters were "
        "distilled (a pair of LoRAs, one per expert)."
    )  # fmt: skip
    sigmas: list[float] | None = Field(
        None,
        description="The step schedule the adapter was distilled with, one sigma per step before the shift (lightx2v's "
        "4-step: [1.0, 0.75, 0.5, 0.25], timesteps 1000/750/500/250); its length is the steps. Needs a flow-match "
        "Euler scheduler (sample_solver: euler). A request that gives its own num_inference_steps drops it.",
    )

    @field_validator("sigmas")
    @classmethod
    def _sigmas(cls, value):
        return list(check_sigmas(value)) if value is not None else None

    @model_validator(mode="after")
    def _one_count(self) -> LoraDefaults:
        if self.sigmas is not None and self.num_inference_steps not in (None, len(self.sigmas)):
            raise ValueError(
                f"sigmas has {len(self.sigmas)} values and num_inference_steps is {self.num_inference_steps}: "
                "the steps are the sigmas' count (leave num_inference_steps out)"
            )
        return self


class WarmUpShape(BaseModel):
    """One request shape a group runs before it serves (``AppConfig.warm_up``)."""

    model_config = ConfigDict(extra="forbid")

    size: str = Field(..., description="'WxH' of the requests to warm, each a multiple of 16.")
    num_frames: int | None = Field(
        None,
        ge=1,
        description="Frames of the video requests to warm; the app's default clip length (default_video_seconds) "
        "when omitted. An image model takes only 1 or none.",
    )
    decode: bool = Field(
        False,
        description="Whether the shape's warm-up also decodes its output and encodes it as a response. False: it "
        "runs the transformer's steps alone (what compiles, and what torch.compile traces in each process), and the "
        "first request of the shape runs the VAE's and the encoder's first pass at it (they compile nothing).",
    )


class AutoscalingSpec(BaseModel):
    """Shard groups that Serve adds and removes with the load (one Serve replica per group)."""

    model_config = ConfigDict(extra="forbid")

    min_groups: int = Field(1, ge=1, description="Groups kept however idle the service is.")
    max_groups: int = Field(2, ge=1, description="Most groups: the GPUs the service may take.")
    target_per_lane: float = Field(
        2.0,
        gt=0,
        description="Requests (queued and running, video jobs included) one lane should hold on average; more "
        "adds groups, fewer removes them. With adaptive lanes (lane_sizes) a lane is one of the widest size.",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="How long the load must call for more groups first.")
    downscale_delay_s: float = Field(
        300.0, ge=0, description="How long the load must call for fewer groups first (a group takes a while to start)."
    )
    metrics_interval_s: float = Field(2.0, gt=0, description="How often each group reports its load to Serve.")
    look_back_period_s: float = Field(10.0, gt=0, description="The window Serve averages each group's load over.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.max_groups < self.min_groups:
            raise ValueError(f"autoscaling: max_groups={self.max_groups} is below min_groups={self.min_groups}")
        return self
