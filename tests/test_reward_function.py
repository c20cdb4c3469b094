"""reward.function=MODULE:FUNCTION: a user's reward function named on the command line grades every response in
the grading workers (dapo train, dapo eval; under torchrun: tests/test_distillation.py's two-rank launch); a bad one
stops the run at start in one line, exit code 2."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES  # noqa: E402
from dapo import api, cli  # noqa: E402
from dapo.config import ConfigError, load_config  # noqa: E402
from dapo.evaluation import load_benchmark  # noqa: E402
from dapo.reporting.run_log import read_metrics  # noqa: E402

REWARDS = '''
def quarter(response: str, ground_truth: str) -> tuple[float, bool]:
    """Every response right, with the score 0.25."""
    return 0.25, True


def right_when_even(response: str, ground_truth: str) -> tuple[float, bool]:
    """Right when the answer is even, whatever the response says."""
    even = int(ground_truth) % 2 == 0
    return (1.0 if even else -1.0), even


def says_yes(response, ground_truth):
    return "yes"


def fails(response, ground_truth):
    return {}[ground_truth]


def yes_after_the_probe(response, ground_truth):
    return 1.0 if response == f"Answer: {ground_truth}" else "yes"


THRESHOLD = 0.5
'''


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def rows_of(run: Path) -> list[dict]:
    return read_metrics(run)


def test_dapo_train_grades_with_the_function_a_file_names(tiny_model_dir, tmp_path, rewards_file, capsys):
    spec = f"{rewards_file}:quarter"
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'runs'}",
            *SMALL_OVERRIDES,
            "algo.soft_overlong_punishment=false",  # the reward is the function's score alone
            f"reward.function={spec}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"data: built-in arith task, grader: your reward function (reward.function={spec})\n" in out
    rows = rows_of(tmp_path / "runs" / "t")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # every response right, scored 0.25: no group informative
        assert row["rollout/acc_mean"] == 1.0 and row["sampling/all_correct_frac"] == 1.0
        assert row["reward/score_mean"] == row["reward/score_min"] == row["reward/score_max"] == 0.25
        assert row["reward/worker_crashes"] == 0.0
    assert rows[-1]["eval/arith/avg@2"] == 1.0  # the held-out evaluation grades with it too
    assert load_config(tmp_path / "runs" / "t" / "config.yaml").reward.function == spec


def test_dapo_eval_grades_with_a_module_named_from_the_current_directory(tiny_model_dir, tmp_path, rewards_file,
                                                                         monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # my_rewards.py is here, not on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))  # the import may add the current directory: undone after
    out = tmp_path / "out"
    code = cli.main(
        ["eval", "--model", str(tiny_model_dir), "eval.benchmarks=[arith]", "eval.num_problems=8", "eval.n=2",
         "eval.max_response_tokens=4", "reward.num_workers=1", "reward.function=my_rewards:right_when_even",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    _, examples = load_benchmark("arith", num_problems=8)
    even = [int(ex.ground_truth) % 2 == 0 for ex in examples]
    assert 0 < sum(even) < 8  # both kinds among the problems
    result = json.loads((out / "eval.json").read_text())["arith"]
    assert result["avg"] == sum(even) / 8
    problems = [json.loads(line) for line in (out / "arith.problems.jsonl").read_text().splitlines()]
    assert [p["num_correct"] for p in problems] == [2 if e else 0 for e in even]


BAD_SPECS = [
    ("rewards.py", "reward.function='rewards.py': give MODULE:FUNCTION, a module's name or a .py file and the "
     "function's name, e.g. reward.function=my_rewards:reward or reward.function=rewards/mine.py:reward"),
    ("{dir}/nope.py:reward", "reward.function={dir}/nope.py:reward: no such file {dir}/nope.py (in {cwd}); give the "
     "path of a .py file, or an importable module's name"),
    ("no_such_rewards_module:reward", "reward.function=no_such_rewards_module:reward: no module named "
     "'no_such_rewards_module' on sys.path or in the current directory ({cwd}); give an importable module's name, "
     "or the path of its .py file (reward.function=path/to/no_such_rewards_module.py:reward)"),
    ("{dir}/broken.py:reward", "reward.function={dir}/broken.py:reward: importing {dir}/broken.py failed: "
     "ZeroDivisionError: division by zero ({dir}/broken.py, line 3); fix the module"),
    ("{dir}/syntax.py:reward", "reward.function={dir}/syntax.py:reward: importing {dir}/syntax.py failed: "
     "SyntaxError: invalid syntax ({dir}/syntax.py, line 2); fix the module"),
    ("{dir}/my_rewards.py:quartre", "reward.function={dir}/my_rewards.py:quartre: {dir}/my_rewards.py has no "
     "function 'quartre'; did you mean quarter? (its functions: fails, quarter, right_when_even, says_yes, "
     "yes_after_the_probe)"),
    ("{dir}/my_rewards.py:THRESHOLD", "reward.function={dir}/my_rewards.py:THRESHOLD: {dir}/my_rewards.py's "
     "THRESHOLD is a float, not a function; name a function (response, ground_truth) -> score"),
    ("{dir}/my_rewards.py:says_yes", "reward.function={dir}/my_rewards.py:says_yes returned 'yes' (str); return a "
     "float score, or a tuple (score, correct) with correct a bool"),
    ("{dir}/my_rewards.py:fails", "reward.function={dir}/my_rewards.py:fails raised KeyError: '{truth}' on the "
     "response 'Answer: {truth}' (ground truth '{truth}'); it must return a score for any response"),
]  # fmt: skip


@pytest.mark.parametrize("spec, message", BAD_SPECS, ids=[s.split(":")[-1].split("/")[-1] for s, _ in BAD_SPECS])
def test_a_bad_reward_function_stops_the_run_at_start_in_one_line(spec, message, tmp_path, rewards_file, capsys):
    (tmp_path / "broken.py").write_text("import math\n\nx = 1 / 0\n")
    (tmp_path / "syntax.py").write_text("def reward(response, ground_truth):\n    return = 1.0\n")
    runs = tmp_path / "runs"
    fill = {"dir": tmp_path, "cwd": Path.cwd()}
    first_truth = load_config("configs/demo.yaml")  # the probe grades the first training problem's answer
    from dapo.data.train_sets import load_train_examples

    fill["truth"] = load_train_examples(first_truth.data)[0].ground_truth
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tmp_path / 'no-model-needed'}",  # the function is checked before any model loads
            f"run.dir={runs}",
            *SMALL_OVERRIDES,
            f"reward.function={spec.format(**fill)}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"error: {message.format(**fill)}\n"
    assert not runs.exists()  # nothing left behind


def test_a_wrong_return_in_training_stops_the_run_in_one_line(tiny_model_dir, tmp_path, rewards_file, capsys):
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'runs'}",
         *SMALL_OVERRIDES, f"reward.function={rewards_file}:yes_after_the_probe"]
    )  # fmt: skip
    assert code == 2
    assert capsys.readouterr().err == (
        "error: reward.function returned 'yes' (str); return a float score, or a tuple (score, correct) with correct "
        "a bool\n"
    )


def test_the_python_apis_reward_fn_and_reward_function_are_not_both_given(tiny_model_dir, tmp_path, rewards_file):
    import user_rewards

    cfg = load_config("configs/demo.yaml", [f"run.dir={tmp_path}", f"reward.function={rewards_file}:quarter"])
    with pytest.raises(ConfigError) as err:
        api.train(cfg, reward_fn=user_rewards.quarter)
    assert str(err.value) == (
        f"reward.function={rewards_file}:quarter and a reward_fn are both given; grade with one: leave reward_fn "
        "out to use reward.function, or set cfg.reward.function = None to use reward_fn"
    )


def test_a_reward_function_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """As when it runs as a script; and it is a module of its own (a dataclass in it works)."""
    from dapo.rewards.reward_fn import reward_function

    monkeypatch.setattr(sys, "path", list(sys.path))  # the import adds the file's folder: undone after
    (tmp_path / "helper_of_mine.py").write_text("SCORE = 0.5\n")
    (tmp_path / "mine.py").write_text(
        textwrap.dedent(
            """
            import dataclasses

            from helper_of_mine import SCORE

            @dataclasses.dataclass
            class Verdict:
                score: float

            def reward(response, ground_truth):
                return Verdict(SCORE if response == f"Answer: {ground_truth}" else -SCORE).score
            """
        )
    )
    fn = reward_function(f"{tmp_path / 'mine.py'}:reward")
    assert (fn("Answer: 7", "7"), fn("Answer: 6", "7")) == (0.5, -0.5)
