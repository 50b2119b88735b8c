"""The README stays short and every page's links and repository paths resolve."""

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
