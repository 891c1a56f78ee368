"""The generated fleet-document reference covers every field and is up to date."""

from __future__ import annotations

from pathlib import Path

from narwhal.reference import document_fields, fleet_reference_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "fleet-reference.md"


def test_reference_covers_every_field() -> None:
    text = fleet_reference_markdown()
    paths = [path for path, _, _ in document_fields()]
    assert len(paths) > 60
    for path in paths:
        assert f"| `{path}` |" in text, path
    # Every field has a description from its class docstring.
    for line in text.splitlines():
        if line.startswith("| `$"):
            assert not line.rstrip().endswith("|  |"), line
    assert "`$.engines[].sim.faults[].kind`" in text


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == fleet_reference_markdown(), (
        "docs/fleet-reference.md is stale: run `python -m narwhal.reference > docs/fleet-reference.md`"
    )
