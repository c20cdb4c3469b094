"""docs/reference/ is generated from the code (scripts/reference.py): the committed pages are what it says now."""

import dataclasses
import importlib.util
import re
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


def row(key: str) -> list[str]:
    """The config reference's cells for ``key``: setting, type, default, allowed, description."""
    (line,) = [line for line in PAGES[reference.CONFIG_PAGE].splitlines() if line.startswith(f"| `{key}` |")]
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_the_allowed_column_states_the_rules_between_settings_beside_each_setting_they_involve():
    from dapo.config.rules import RULES

    screen = "`algo.screen_samples` is 0 (off) or from 2 to `rollout.group_size` - 1, with `algo.dynamic_sampling=true`"
    for key in ("algo.screen_samples", "rollout.group_size", "algo.dynamic_sampling"):
        assert screen in row(key)[3], key
    assert row("algo.screen_samples")[3].startswith(">= 0; ")
    divides = "`train.mini_batch_prompts` divides `train.prompts_per_step`"
    assert row("train.mini_batch_prompts")[3] == row("train.prompts_per_step")[3] == f"> 0; {divides}"
    assert row("run.resume")[3] == "`run.overwrite=true` needs `run.resume=false`"  # a bool: no range of its own
    for rule in RULES:  # each statement, from its declaration, beside every setting it involves
        assert all(rule.says in row(key)[3] for key in rule.keys), rule.keys
    assert row("train.lr")[3] == "> 0"  # a setting no rule involves: its own range alone


def test_the_reference_says_the_default_a_run_generating_ahead_fills():
    assert row("algo.rollout_is_cap")[2] == "`null`; `2.0` with `rollout.max_staleness` > 0 and not given"
    assert row("rollout.max_staleness")[3].endswith(
        "; `algo.rollout_is_cap` is `2.0` with `rollout.max_staleness` > 0 and not given"
    )


def test_descriptions_speak_of_the_setting_not_the_code():
    """No description cites dapo's modules (dapo.collect.screening, kernels.py) or its constants (ASYNC_IS_CAP)."""
    import dapo
    from dapo.config import read, rules, schema

    files = {p.name for p in Path(dapo.__file__).parent.rglob("*.py") if p.name != "__init__.py"}
    constants = {name for module in (read, rules, schema) for name in vars(module) if name.isupper() and len(name) > 3}
    code = re.compile(r"\bdapo\.[a-z]|\b(" + "|".join(map(re.escape, sorted(files | constants))) + r")\b")
    assert code.search("(dapo.model.kernels)") and code.search("kernels.py") and code.search("2 (ASYNC_IS_CAP)")
    cited = {key: text for key, text in reference.descriptions().items() if code.search(text)}
    assert not cited, cited
