"""The manual says what the code does: every setting is on the settings page, and every
page a document links to exists."""

from __future__ import annotations

import re
from pathlib import Path

from monitor.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def test_the_settings_page_names_every_setting_and_no_other():
    first_cells = [line.split("|")[1] for line in (REPO / "docs" / "settings.md").read_text().splitlines()
                   if line.startswith("| `")]
    named = {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    fields = {name.upper() for name in Settings.model_fields}
    assert fields - named == set(), "settings missing from docs/settings.md"
    assert named - fields == set(), "docs/settings.md names settings that do not exist"


def test_every_link_between_documents_leads_somewhere():
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "alerts").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken
