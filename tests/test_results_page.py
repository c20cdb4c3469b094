"""benchmarks/RESULTS.md is what scripts/results_page.py renders from benchmarks/results/*.json, at most 400 lines,
and every results file says when, at which commit, on what machine and under which load its figures were measured,
or that the record does not say; the screening summaries are their details files' seeds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results_page  # noqa: E402
from results_page import GROUPS, cell, machine_text, provenance, read_results, render  # noqa: E402

COMMIT = re.compile(r"[0-9a-f]{40}")
DATE = re.compile(r"\d{4}-\d\d-\d\d")


def test_the_page_is_what_the_results_files_render():
    assert results_page.PAGE.read_text() == render(read_results()), "stale: python scripts/results_page.py"


def test_the_page_is_at_most_400_lines():
    assert len(results_page.PAGE.read_text().splitlines()) <= results_page.MAX_LINES == 400


@pytest.mark.parametrize("name", sorted(read_results()), ids=str)
def test_a_results_file_says_when_where_and_on_what_or_that_it_was_not_recorded(name):
    content = read_results()[name]
    assert content["group"] in GROUPS and content["title"] and content["measures"] and content["figures"]
    assert content.get("date") is None or DATE.fullmatch(content["date"])
    assert content.get("commit") is None or COMMIT.fullmatch(content["commit"])
    if not (content.get("date") and content.get("commit")):  # then the record it was transcribed from says when
        assert COMMIT.fullmatch(content["recorded_in"]["commit"]) and DATE.fullmatch(content["recorded_in"]["date"])
    assert "machine" in content and "load" in content or "load_average_1min" in (content.get("machine") or {})


def test_a_stale_page_fails_the_check_and_writing_it_mends_it(tmp_path, monkeypatch, capsys):
    page = tmp_path / "RESULTS.md"
    monkeypatch.setattr(results_page, "PAGE", page)
    page.write_text("# Benchmark results\n\nan edit by hand\n")
    assert results_page.main(["--check"]) == 1
    assert "benchmarks/RESULTS.md is stale: python scripts/results_page.py" in capsys.readouterr().err
    monkeypatch.setattr(results_page, "ROOT", tmp_path)
    assert results_page.main([]) == 0
    assert results_page.main(["--check"]) == 0


def test_a_file_that_is_not_a_results_file_of_the_page_fails_naming_it(tmp_path):
    (tmp_path / "raw.json").write_text(json.dumps({"ds": [], "command": "python benchmarks/screening.py"}))
    with pytest.raises(ValueError, match=r"raw\.json has no title, group, measures, figures"):
        read_results(tmp_path)


def test_figures_are_written_as_measured_and_a_missing_one_as_a_dash():
    assert [cell(x) for x in (44.2, 0.28625, 47.12390605099972, 0.0, 3.816e-05, 1066818.0)] == [
        "44.2",
        "0.28625",
        "47.12",
        "0.0",
        "0.00003816",
        "1,066,818",
    ]
    assert [cell(x) for x in (None, True, 671183, 85, "a | b")] == ["-", "yes", "671,183", "85", "a \\| b"]
    assert cell({"mean": 2.57, "ci95": 0.06}) == "2.57 ± 0.06"
    assert cell({"step": 0, "avg": 0.28625, "ci": [0.255, 0.32]}) == "step 0, avg 0.28625, ci [0.255, 0.32]"
    assert cell([39.0, 45.6]) == "39.0, 45.6"


def test_what_the_record_does_not_say_is_said_not_recorded():
    assert machine_text(None) == "not recorded"
    assert machine_text({"cpu": None, "amx": None, "avx512": None, "cores": 2}) == "2 cores, CPU not recorded"
    amx = {"cpu": None, "amx": True, "avx512": True, "cores": 2, "note": "a Xeon"}
    assert machine_text(amx) == "2 cores, AMX, AVX-512 (a Xeon); CPU model not recorded"
    epyc = {"cpu": "AMD EPYC", "amx": False, "avx512": False, "cores": 2, "usable_cores": 1}
    assert machine_text(epyc) == "AMD EPYC, 2 cores (1 usable), no AMX, no AVX-512"
    transcribed = {"date": None, "commit": None, "machine": None, "load": None}
    transcribed["recorded_in"] = {"file": "benchmarks/RESULTS.md", "commit": "a" * 40, "date": "2026-11-23"}
    assert provenance(transcribed) == (
        "Date and commit not recorded; on this page since `aaaaaaa` (2026-11-23). Machine: not recorded. "
        "Load: not recorded."
    )


def test_an_unknown_group_fails():
    content = read_results()["memory"] | {"group": "Elsewhere"}
    with pytest.raises(ValueError, match="'Elsewhere'"):
        render({"memory": content})


@pytest.mark.parametrize(("name", "details"), [("screening_on_demo", "demo"), ("screening_on_smollm2", "smollm2")])
def test_the_screening_summaries_are_their_details_files_every_seed_as_measured(name, details):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from screening import at_tokens

    runs = json.loads((ROOT / "benchmarks" / "results" / "screening" / f"{details}.json").read_text())
    for setting, table in read_results()[name]["figures"].items():
        measured = runs[setting.split(":")[0]]
        budget = min(r["curve"][-1]["tokens"] for rs in measured.values() for r in rs)  # every side's, as printed
        per_seed = {table[i]["side"]: table[i + 1] for i in range(0, len(table), 2)}  # a side, then its seeds
        for side, row in per_seed.items():
            rs = measured[side]
            assert row["tokens per trained token"] == [round(r["tokens_per_trained"], 2) for r in rs]
            assert row["CPU s / step"] == [round(r["cpu_s_per_step"], 2) for r in rs]
            assert row["held-out at equal steps (%)"] == [round(100 * r["curve"][-1]["acc"], 1) for r in rs]
            assert row["held-out at equal tokens (%)"] == [round(100 * at_tokens(r["curve"], budget), 1) for r in rs]
