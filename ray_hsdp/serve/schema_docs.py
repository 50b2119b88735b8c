"""``docs/requests.md``, generated from the request bodies' field declarations (``schema``):

    python -m ray_hsdp.serve.schema_docs > docs/requests.md

``tests/serve/test_schema.py`` fails when the page and the models disagree.
"""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ray_hsdp.serve.request_fields import GenerationFields
from ray_hsdp.serve.schema import ImageGenerationRequest, VideoCreateRequest

#: Each bound a field may declare (pydantic's ``ge``, ``gt``, ``le``, ``lt``), as the page writes it.
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _range(field: FieldInfo) -> str:
    bounds = [(name, getattr(m, name, None)) for m in field.metadata for name in BOUNDS]
    return ", ".join(f"{BOUNDS[name]} {value}" for name, value in bounds if value is not None)


def _default(field: FieldInfo) -> str:
    return "required" if field.is_required() else f"`{field.default!r}`"


def _rows(model: type[BaseModel], names) -> list[str]:
    rows = []
    for name in names:
        field = model.model_fields[name]
        description = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {_default(field)} | {_range(field)} | {description} |")
    return rows


def markdown() -> str:
    """The whole page."""
    shared = list(GenerationFields.model_fields)

    def own(model: type[BaseModel]) -> list[str]:
        return [name for name in model.model_fields if name not in shared]

    lines = [
        "# Request fields",
        "",
        "Generated from the request bodies' declarations",
        "(`python -m ray_hsdp.serve.schema_docs > docs/requests.md`); a test fails when it is stale. What each",
        "route answers, and vllm-omni's names beside ours: `docs/api.md`. An unknown field is a 400 that names it.",
    ]
    sections = (
        ("Both routes", "`POST /v1/images/generations` and `POST /v1/videos` (and `/v1/videos/sync`).",
         GenerationFields, shared),
        ("`POST /v1/images/generations`", "A JSON body; each value of its type (no numbers as text).",
         ImageGenerationRequest, own(ImageGenerationRequest)),
        ("`POST /v1/videos`", "A multipart form (as the `openai` client sends it), a urlencoded form or JSON: "
         "numbers may come as text.", VideoCreateRequest, own(VideoCreateRequest)),
    )  # fmt: skip
    for title, summary, model, names in sections:
        lines += [
            "",
            f"## {title}",
            "",
            summary,
            "",
            "| field | default | range | what it does |",
            "| --- | --- | --- | --- |",
        ]
        lines += _rows(model, names)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
