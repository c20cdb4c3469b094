"""docs/reference/ is generated from the code (scripts/reference.py): the committed pages are what it says now."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reference", REPO / "scripts" / "reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

PAGES = reference.pages()


@pytest.mark.parametrize("page", sorted(PAGES), ids=str)
def test_the_committed_reference_pages_are_what_the_code_generates(page):
    committed = REPO / page
    assert committed.is_file() and committed.read_text() == PAGES[page], (
        f"{page} is stale: run python scripts/reference.py (make format)"
    )


def test_every_setting_and_every_command_is_in_the_reference():
    from dapo.config import settings

    config, cli = PAGES[reference.CONFIG_PAGE], PAGES[reference.CLI_PAGE]
    assert all(f"| `{key}` |" in config for key, _, _ in settings())
    assert all(f"## dapo {name}" in cli for name in reference.commands())
    assert "## dapo train" in cli and "| `--seeds SEEDS` | `5` |" in cli


def test_a_field_without_a_comment_stops_the_generator(monkeypatch):
    @dataclasses.dataclass
    class Section:
        said: int = 1  # what it does
        unsaid: int = 2

    assert reference.field_comments(Section) == {"said": "what it does", "unsaid": ""}
    monkeypatch.setattr(reference, "field_comments", lambda cls: {})
    with pytest.raises(SystemExit, match=r"no description for model\.path, .*: add a comment"):
        reference.descriptions()


def test_a_description_is_the_comment_above_then_the_ones_on_the_declaration():
    from dapo.config import EvalConfig, RunConfig

    said = reference.field_comments(EvalConfig)
    assert said["n"].startswith("sampling; null: the benchmark's own") and said["n"].endswith(
        "; samples per problem (avg@n)"
    )
    assert reference.field_comments(RunConfig)["dir"] == "the run lives in <dir>/<name>"


def test_the_check_names_a_stale_page_and_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    for page, text in PAGES.items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text(text)
    assert reference.main(["--check"]) == 0
    (tmp_path / reference.CLI_PAGE).write_text("old\n")
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().out == "docs/reference/cli.md is stale: make format\n"
