"""``docs/configuration.md``, generated from the config models' field descriptions:

    python -m ray_hsdp.config.docs > docs/configuration.md

``tests/test_config.py`` fails when the page and the models disagree.
"""

from __future__ import annotations

from pydantic import BaseModel

from ray_hsdp.config.app import AppConfig
from ray_hsdp.config.blocks import AutoscalingSpec, LoraDefaults, StepCacheConfig, WarmUpShape
from ray_hsdp.config.group import GroupKernels, GroupLayout, GroupQueue, RequestFeatures, ServedModel

#: The models the page describes, with what each section says of where its fields go.
SECTIONS: tuple[tuple[str, type[BaseModel], str], ...] = (
    *(
        (f"Group: {part.__doc__.split(':')[0].rstrip('.')} (`{part.__name__}`)", part, part.__doc__)
        for part in (ServedModel, GroupLayout, GroupKernels, GroupQueue, RequestFeatures)
    ),
    (
        "Application (`AppConfig`)",
        AppConfig,
        "The Serve application (the YAML's `args`): the group's fields above (`GroupConfig`), plus request "
        "defaults and limits.",
    ),
    ("`cache`", StepCacheConfig, "A group's step cache and the settings a request gets."),
    ("`autoscaling`", AutoscalingSpec, "Shard groups that Serve adds and removes with their load."),
    ("`lora_defaults.<adapter>`", LoraDefaults, "What a request naming the adapter gets for the fields it omits."),
    ("`warm_up[]`", WarmUpShape, "One shape of the list: what a group runs before it serves."),
)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return "its fields below" if isinstance(value, BaseModel) else f"`{value!r}`"


def _rows(model: type[BaseModel], skip: set[str]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {_default(field)} | {description} |")
    return rows


def markdown() -> str:
    """The whole page."""
    lines = [
        "# Configuration",
        "",
        "Generated from the config models (`python -m ray_hsdp.config.docs > docs/configuration.md`); a test",
        "fails when it is stale. Pairs of settings that cannot meet are refused at start: `docs/pairs.md`.",
    ]
    described: set[str] = set()
    for title, model, summary in SECTIONS:
        lines += ["", f"## {title}", "", summary, "", "| field | default | what it does |", "| --- | --- | --- |"]
        # AppConfig repeats GroupConfig's fields: each field is listed once, where it is declared.
        lines += _rows(model, described if model is AppConfig else set())
        described |= set(model.model_fields) if model is not AppConfig else set()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
