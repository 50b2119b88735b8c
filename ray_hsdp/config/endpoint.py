"""One application, one endpoint, one or several models: which fields belong to the endpoint (set
once for the application: the key, the body and image limits, ``retry_after_s``, the video job
table's limits) and which to each model (everything else of ``AppConfig``).

A Serve YAML's ``args`` is either one model's ``AppConfig`` (today's one-model YAMLs) or::

    args:
      allow_unauthenticated: false      # endpoint fields, once
      models:
        - {model: /models/Wan2.2-T2V-A14B, shard_size: 4, ...}
        - {model: /models/Qwen-Image, model_name: qwen-image, ...}

Or, so that each model is a unit of change, the endpoint and each model are applications of their
own (``serve.app.build_endpoint``, ``build_model``): the endpoint's ``args`` name the model
applications (``endpoint_args``), each model application's ``args`` are its fields alone
(``model_args``), and the endpoint's fields may go in the ingress' ``user_config``, where an edit
applies in place.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from ray_hsdp.config.app import AppConfig, check_lasting_store

#: The fields of the endpoint, not of a model: one value for the whole application.
ENDPOINT_FIELDS = (
    "api_key_env",
    "api_key_file",
    "allow_unauthenticated",
    "max_body_bytes",
    "max_image_bytes",
    "retry_after_s",
    "max_video_jobs",
    "max_video_bytes",
    "video_ttl_s",
    "video_stale_after_s",
    "video_lost_wait_s",
    "video_max_attempts",
    "sync_wait_s",
    "job_store",
    "media_store",
    "job_store_password_file",
    "job_store_password_env",
)


class _EndpointChecks(BaseModel):
    """What the endpoint's fields must hold together (as ``AppConfig`` checks them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _check_stores(self):
        check_lasting_store(self.job_store, self.media_store)
        return self


#: The endpoint's configuration: ``AppConfig``'s endpoint fields, with their defaults and descriptions.
EndpointConfig = create_model(
    "EndpointConfig",
    __base__=_EndpointChecks,
    **{name: (AppConfig.model_fields[name].annotation, AppConfig.model_fields[name]) for name in ENDPOINT_FIELDS},
)


class ServedModels(NamedTuple):
    """What one application serves: its endpoint and its models, in the order given."""

    endpoint: EndpointConfig
    models: list[AppConfig]

    @property
    def names(self) -> list[str]:
        """The models' ids (``model`` in a request)."""
        return [model.served_model_name for model in self.models]


def served_models(args: dict) -> ServedModels:
    """Reads an application's ``args``: one model's fields, or endpoint fields and ``models``.

    Every model's ``AppConfig`` carries the endpoint's values of the endpoint fields.

    Raises:
        ValueError: An endpoint field in a model's block, a model field beside ``models``, no
            model, two models of one id, or a field a model refuses (pydantic's message).
    """
    if "models" not in args:
        config = AppConfig(**args)
        return ServedModels(EndpointConfig(**{name: getattr(config, name) for name in ENDPOINT_FIELDS}), [config])
    blocks = args["models"]
    one = len(set(args) - set(ENDPOINT_FIELDS) - {"models"}) == 1
    endpoint_args = _beside_models(
        args,
        f"{'belongs' if one else 'belong'} to a model, not to the endpoint: set {'it' if one else 'them'} in each "
        "model's block under models",
    )
    if not isinstance(blocks, list) or not blocks or not all(isinstance(block, dict) for block in blocks):
        raise ValueError("models must be a list of at least one model's fields (each a mapping with its model)")
    endpoint = EndpointConfig(**endpoint_args)
    models = []
    for index, block in enumerate(blocks):
        where = f"models[{index}] ({block.get('model_name') or block.get('model', '?')})"
        _refuse_endpoint_fields(block, where)
        try:
            models.append(AppConfig(**block, **endpoint.model_dump()))
        except ValidationError as err:
            raise ValueError(f"{where}: {err}") from None
    names = [model.served_model_name for model in models]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"two models are named {', '.join(twice)}: give each its own model_name")
    return ServedModels(endpoint, models)


def _beside_models(args: dict, why: str) -> dict:
    """The fields beside ``models``, all of them the endpoint's.

    Raises:
        ValueError: Naming the model fields among them, ``why`` they do not go there, and what does.
    """
    fields = {name: value for name, value in args.items() if name != "models"}
    misplaced = sorted(set(fields) - set(ENDPOINT_FIELDS))
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} {why} (beside models go only {', '.join(ENDPOINT_FIELDS)})")
    return fields


def _refuse_endpoint_fields(fields: dict, where: str) -> None:
    inside = sorted(set(fields) & set(ENDPOINT_FIELDS))
    if inside:
        verb = "belongs" if len(inside) == 1 else "belong"
        raise ValueError(
            f"{where} sets {', '.join(inside)}, which {verb} to the endpoint: set it once, in the endpoint "
            "application's args or its ingress' user_config"
        )


def endpoint_args(args: dict) -> tuple[EndpointConfig, list[str]]:
    """Reads an endpoint application's ``args``: its endpoint fields and ``models``, the names of the
    model applications it serves (each application named by its model's id).

    Raises:
        ValueError: No ``models``, a model's fields here, or an endpoint field pydantic refuses.
    """
    models = args.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(
            "models must list the model applications this endpoint serves, by name (each named by its model's id), "
            f"got {models!r}"
        )
    if len(set(models)) != len(models):
        raise ValueError(f"models names an application twice: {models}")
    fields = _beside_models(
        args, "of the endpoint application: a model's fields go in its own application (ray_hsdp.serve:build_model);"
    )
    return EndpointConfig(**fields), models


def model_args(args: dict) -> AppConfig:
    """Reads a model application's ``args``: one model's fields, no endpoint field.

    Raises:
        ValueError: An endpoint field, or a field the model refuses (pydantic's message).
    """
    _refuse_endpoint_fields(args, "a model application")
    return AppConfig(**args)


#: The import paths of the split layout's applications (``serve.app``).
ENDPOINT_IMPORT = "ray_hsdp.serve:build_endpoint"
MODEL_IMPORT = "ray_hsdp.serve:build_model"


def folded_applications(applications: list[dict]) -> dict | None:
    """The one application's ``args`` (endpoint fields and ``models``) that a split layout's
    applications describe, for a runner of one application (``ray-hsdp serve --config``); ``None``
    where ``applications`` hold no endpoint application. The ingress' ``user_config`` counts as the
    endpoint's args, as it does when Serve deploys the layout.

    Raises:
        ValueError: The endpoint names a model application the list lacks.
    """
    endpoint = next((app for app in applications if app.get("import_path") == ENDPOINT_IMPORT), None)
    if endpoint is None:
        return None
    args = dict(endpoint.get("args") or {})
    for deployment in endpoint.get("deployments") or []:
        args.update(deployment.get("user_config") or {})
    by_name = {app.get("name"): app for app in applications if app.get("import_path") == MODEL_IMPORT}
    names = args.pop("models", None) or []
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(f"the endpoint serves {', '.join(missing)}, which no application of {MODEL_IMPORT} is named")
    return {**args, "models": [dict(by_name[name].get("args") or {}) for name in names]}
