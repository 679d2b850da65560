"""The docs match the code: the README's configuration table is generated from the settings."""

from __future__ import annotations

from pathlib import Path

from tokenbus.config import _groups, markdown_table, with_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_configuration_table_matches_the_settings() -> None:
    text = README.read_text()
    assert with_table(text) == text, (
        "README's configuration table is stale: run `tokenbus config --update README.md`"
    )


def test_every_setting_says_what_it_is_for() -> None:
    missing = [
        f"{cls.__name__}.{name}"
        for _, cls, _ in _groups()
        for name, field in cls.model_fields.items()
        if not field.description
    ]
    assert not missing, f"settings without a description: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = text.split("```", 2)[1]
    assert "make run" in first_block
    assert "make test" in first_block
    assert "TOKENBUS_WORKER_ENGINE" in markdown_table()
