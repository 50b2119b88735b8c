"""The README stays short, every page's links and repository paths resolve, and every `ray-hsdp`
command and flag the pages show exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_link_and_path_resolves():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not target.startswith("http") and not (page.parent / target).exists():
                missing.append((page.name, target))
        for path in re.findall(r"`((?:docs|bench|serve_configs|notebooks|ray_hsdp|tests)/[^`\s*{<]*)`", text):
            if not (ROOT / path.split("::")[0].rstrip("/")).exists():
                missing.append((page.name, path))
    assert not missing, missing


def cli_flags() -> dict[str, set[str]]:
    """Subcommand -> the flags ``ray-hsdp`` takes there."""
    from ray_hsdp.cli.commands import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    return {
        name: {option for action in sub._actions for option in action.option_strings}
        for name, sub in subparsers.choices.items()
    }


def test_every_cli_command_and_flag_the_docs_name_exists():
    """Each ``ray-hsdp COMMAND --flag`` the pages show (commands on one line, up to a comment or
    the end of the code span) names a command and flags that the CLI takes."""
    flags = cli_flags()
    wrong = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            for command, rest in re.findall(r"ray-hsdp ([a-z][a-z-]*)([^`#|]*)", line):
                if command not in flags:
                    wrong.append((page.name, command))
                    continue
                wrong += [(page.name, command, flag) for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest)
                          if flag not in flags[command]]  # fmt: skip
    assert not wrong, wrong


def config_fields() -> set[str]:
    """Every field of the application's configuration, nested models' (``cache``, ``autoscaling``) included."""
    import typing

    from pydantic import BaseModel

    from ray_hsdp.config.app import AppConfig

    fields, models = set(), [AppConfig]
    while models:
        model = models.pop()
        for name, info in model.model_fields.items():
            fields.add(name)
            for kind in (info.annotation, *typing.get_args(info.annotation)):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    models.append(kind)
    return fields


#: ``key: value`` spans of the pages that are not configuration: Serve's YAML, API objects.
NOT_CONFIG = {"object", "proxy_location", "http_options", "host", "port", "applications", "name", "route_prefix",
              "import_path", "args", "runtime_env", "pip", "packages", "pip_install_options", "deployments",
              "code"}  # fmt: skip


def test_every_configuration_field_the_docs_set_exists():
    """Each `field: value` the pages show (outside the dated history beside the results) is a
    field of the configuration: a renamed or removed field cannot linger in the docs."""
    fields = config_fields()
    wrong = [
        (page.name, name)
        for page in PAGES
        for name in re.findall(r"`([a-z_0-9]+): ", page.read_text())
        if name not in fields and name not in NOT_CONFIG
    ]
    assert not wrong, wrong
