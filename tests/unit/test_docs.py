"""docs/configuration.md is generated from the config dataclasses and must not drift from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_configuration_page_is_up_to_date():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    for page in (REPO / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_every_parity_layout_is_listed_in_the_testing_page():
    from tests.integration.layouts import ALL_LAYOUTS, REFERENCES

    page = (REPO / "docs" / "testing.md").read_text()
    for name in [*REFERENCES, *(layout.name for layout in ALL_LAYOUTS)]:
        assert f"`{name}`" in page, f"docs/testing.md does not list the layout {name}"


def test_model_tables_match_the_registry():
    """README's Models row names every registered model and its full-size flavors; docs/models.md's table lists
    every flavor of every model, and no other."""
    import re

    from torchtitan.models.registry import get_model_spec, model_names

    readme_row = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| Models |"))
    table = {}
    for line in (REPO / "docs" / "models.md").read_text().splitlines():
        if m := re.match(r"\| `(\w+)` \| (.*?) \|", line):
            table[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    assert set(table) == set(model_names()), (sorted(table), model_names())
    for name in model_names():
        flavors = set(get_model_spec(name).flavors)
        assert table[name] == flavors, (name, sorted(table[name] ^ flavors))
        assert f"`{name}`" in readme_row, f"README.md's Models row does not name {name}"
        for flavor in sorted(f for f in flavors if not f.startswith("debugmodel")):
            assert f"`{flavor}`" in readme_row, f"README.md's Models row does not list {name}'s {flavor}"
