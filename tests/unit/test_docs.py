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
