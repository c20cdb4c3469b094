"""The Python API: from dapo import load_config, train, evaluate; a user's reward function in the
reward pool (its score as the reward, its time limit and crash isolation); data as lists of dicts;
the README's example, run as the script it is."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import user_rewards
from conftest import SMALL_OVERRIDES
from dapo import evaluate, load_config, train
from dapo.data.files import DataError
from dapo.rewards import RewardFnError

ROOT = Path(__file__).resolve().parents[1]
# rows whose prompts differ (rows with equal prompts are merged); four prompts = one training step's
ROWS = [{"problem": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]


def env() -> dict:
    """The environment of a child Python: this checkout's package and tests/ first."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }


def small(tmp_path, model_dir, *extra):
    # no overlong penalty: the reward of a row is then exactly what the reward function gave it
    return load_config(
        "demo",
        [
            f"model.path={model_dir}",
            f"run.dir={tmp_path}",
            *SMALL_OVERRIDES,
            "algo.soft_overlong_punishment=false",
            *extra,
        ],
    )


def test_the_package_gives_the_functions_also_after_their_modules_are_imported():
    code = """
import sys
import dapo
from dapo import Config, load_config
assert "torch" not in sys.modules, "import dapo and its config must stay light"
import dapo.training, dapo.evaluation, dapo.api
from dapo import train, evaluate
import dapo.training
assert train is dapo.api.train and evaluate is dapo.api.evaluate, (train, evaluate)
assert dapo.train is train and dapo.evaluate is evaluate
assert callable(train) and type(train).__name__ == "function"
print("ok", sorted(n for n in dir(dapo) if not n.startswith("_"))[:4])
"""
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok ['Config', 'ConfigError', 'EvalResult', 'RewardFnError']"), out.stdout


def test_the_reward_fns_score_is_the_reward_and_its_flag_the_accuracy(tiny_model_dir, tmp_path):
    # (-0.5, True) for every response: the built-in graders could give neither that reward nor, with it, acc 1
    cfg = small(tmp_path, tiny_model_dir)
    result = train(cfg, reward_fn=user_rewards.right_but_negative, train_data=ROWS, eval_data=ROWS[:2])
    assert result.run_dir == tmp_path / "t" and (result.run_dir / "checkpoints" / "step_000002").is_dir()
    assert [r["step"] for r in result.history] == [1, 2]
    for row in result.history:
        assert row["reward/score_mean"] == row["reward/score_min"] == row["reward/score_max"] == -0.5
        assert row["rollout/acc_mean"] == 1.0 and row["reward/timeouts"] == row["reward/worker_crashes"] == 0
    # held out on the two rows given, graded by the same function: every sample counts as right
    assert result.eval_after["eval/eval_data/avg@2"] == 1.0 and result.eval_before == {}
    assert result.metrics is result.history[-1]
    assert "held-out accuracy: eval_data avg@2 100.0%" in result.summary()

    # evaluate the run (its latest checkpoint, with the run's config: n=2) on rows, with a float-returning
    # function: 0.25 > 0 counts as right
    ev = evaluate(result.run_dir, ROWS, reward_fn=user_rewards.quarter, out_dir=tmp_path / "ev")
    assert (ev.name, ev.n, ev.num_problems, ev.avg, ev.pass_at[2]) == ("eval_data", 2, 4, 1.0, 1.0)
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["eval_data"]["avg"] == 1.0


def test_a_hanging_reward_fn_times_out_and_training_goes_on(tiny_model_dir, tmp_path):
    rows = ROWS[:2] + [{"problem": "7+7=", "answer": "hang"}, {"problem": "8+8=", "answer": "hang"}]
    cfg = small(tmp_path, tiny_model_dir, "reward.timeout_s=0.1", "eval.benchmarks=[]", "train.total_steps=1")
    t0 = time.monotonic()
    result = train(cfg, reward_fn=user_rewards.hang_on_truth, train_data=rows)
    # the function sleeps 60 s on each of 8 responses; off the CPU, each is stopped by the wall-clock backstop
    # (4 x 0.1 s), tried again with twice the limit, then given up on
    assert time.monotonic() - t0 < 55
    assert len(result.history) == 1
    for row in result.history:  # 4 prompts x 4 responses, half of them hang
        assert row["reward/timeouts"] == row["reward/grading_retries"] == 8 and row["reward/worker_crashes"] == 0
        # a response given up on holds algo.wrong_reward (-1) in the batch, left out of its group's advantage
        assert row["reward/score_mean"] == 0.0 and row["reward/score_min"] == -1.0 and row["rollout/acc_mean"] == 0.5


def test_a_reward_fn_that_kills_its_process_or_raises_is_a_crash(tiny_model_dir, tmp_path, capsys):
    rows = ROWS[:2] + [{"problem": "7+7=", "answer": "die"}, {"problem": "8+8=", "answer": "bug"}]
    cfg = small(tmp_path, tiny_model_dir, "eval.benchmarks=[]", "train.total_steps=1")
    result = train(cfg, reward_fn=user_rewards.die_or_raise_on_truth, train_data=rows)
    (row,) = result.history
    assert row["reward/worker_crashes"] == 8 and row["reward/timeouts"] == 0  # 4 responses each of 'die' and 'bug'
    assert row["reward/score_mean"] == 0.0 and row["rollout/acc_mean"] == 0.5
    # the exception is shown once, with the step it happened in
    console = " ".join(capsys.readouterr().out.split())
    assert console.count("reward_fn raised") == 1
    assert (
        "warning (step 1): reward_fn raised ValueError: the user's bug; the response scores as a crash "
        "([CRASH], -1, counted in reward/worker_crashes)"
    ) in console, console


def test_reward_fns_the_workers_cannot_receive_are_refused_before_anything_runs(tiny_model_dir, tmp_path):
    cfg = small(tmp_path, tiny_model_dir)
    for fn, what in [(lambda r, t: 1.0, "<lambda>"), (user_rewards.make_closure(), "make_closure.<locals>.inner")]:
        with pytest.raises(
            RewardFnError,
            match=rf"^reward_fn=\S*{re.escape(what)} cannot be sent to the reward worker "
            r"processes .*define it with def at the top level",
        ):
            train(cfg, reward_fn=fn, train_data=ROWS)
    with pytest.raises(RewardFnError, match=r"^reward_fn=3 is not callable"):
        evaluate(tiny_model_dir, ROWS, reward_fn=3)
    assert not (tmp_path / "t").exists()


def test_a_reward_fn_returning_the_wrong_type_stops_at_its_first_call(tiny_model_dir, tmp_path):
    cfg = small(tmp_path, tiny_model_dir)
    with pytest.raises(
        RewardFnError,
        match=r"^reward_fn returned 'yes' \(str\); return a float score, or a tuple "
        r"\(score, correct\) with correct a bool$",
    ):
        train(cfg, reward_fn=user_rewards.wrong_type, train_data=ROWS)
    assert not (tmp_path / "t").exists()  # it failed before the first step: the run directory is gone


def test_bad_rows_name_the_row_and_the_field(tiny_model_dir, tmp_path):
    cfg = small(tmp_path, tiny_model_dir)
    with pytest.raises(
        DataError, match=r"^train_data\[1\]: field 'answer' is missing; each row needs 'problem' and 'answer'$"
    ):
        train(cfg, train_data=[ROWS[0], {"problem": "2+2="}])
    with pytest.raises(DataError, match=r"^eval_data\[0\]: field 'problem' must be a string, got int"):
        train(cfg, eval_data=[{"problem": 7, "answer": "7"}])
    with pytest.raises(DataError, match=r"^train_data: expected a list of dicts"):
        train(cfg, train_data={"problem": "1+1=", "answer": "2"})
    assert not (tmp_path / "t").exists()


def test_a_config_changed_in_python_is_checked_like_a_preset(tiny_model_dir, tmp_path):
    from dapo import ConfigError

    cfg = small(tmp_path, tiny_model_dir)
    cfg.algo.eps_low = 1.5
    with pytest.raises(ConfigError, match=r"^algo.eps_low=1.5: must be in \(0, 1\]; the paper uses 0.2"):
        train(cfg)
    cfg.algo.eps_low, cfg.train.total_steps = 0.2, "many"
    with pytest.raises(ConfigError, match=r"^train.total_steps: expected an integer, got 'many'"):
        train(cfg)
    with pytest.raises(TypeError, match=r"^cfg: expected a dapo.Config, got str; read a preset with dapo.load_config"):
        train("demo")


def test_evaluate_a_model_directory_on_a_built_in_benchmark(tiny_model_dir):
    cfg = load_config("demo", ["eval.num_problems=3", "eval.n=2", "reward.num_workers=1"])
    ev = evaluate(tiny_model_dir, "arith", cfg=cfg)
    assert (ev.name, ev.n, ev.num_problems, len(ev.per_problem)) == ("arith", 2, 3, 3)
    assert ev.avg == sum(p["num_correct"] for p in ev.per_problem) / 6
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        evaluate(tiny_model_dir / "nothing", "arith")


def readme_example() -> str:
    """The Python code block of the README's "Python API" section, as it stands."""
    section = (ROOT / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_the_readme_example_runs_as_a_script(tmp_path):
    """The README's example, unchanged, run as a script (so its reward function lives in __main__ and the
    workers run the file again); only load_config is given extra overrides: two small steps, and no
    overlong penalty, so each reward is exactly the example's."""
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    extra = [f"run.dir={tmp_path / 'runs'}", *SMALL_OVERRIDES, "algo.soft_overlong_punishment=false"]
    launcher = (
        "import runpy, dapo.config as c\n"
        "load = c.load_config\n"
        f"c.load_config = lambda preset, overrides=(): load(preset, [*overrides, *{extra!r}])\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher], env=env(), capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^held-out accuracy: eval_data avg@2 \d+\.\d% \[.*\] at step 2", out.stdout, flags=re.M), (
        out.stdout
    )
    assert re.search(r"^held-out avg@2 \d\.\d{3}, 95% CI \(", out.stdout, flags=re.M), out.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # every sample written was graded by the example's function: right exactly when its last line (the
    # prediction a reward function gets) is "Answer: <ground truth>", rewarded +1, else -1
    samples = re.findall(
        r"\(reward ([-+]\d\.\d+), acc (\d), pred '(.*?)', ground truth '(\d+)'",
        "".join(p.read_text() for p in (tmp_path / "runs" / "t" / "samples").glob("*.md")),
    )
    assert len(samples) == 8, samples
    for reward, acc, pred, truth in samples:
        assert (float(reward), acc == "1") == ((1.0, True) if pred == f"Answer: {truth}" else (-1.0, False)), samples


def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_model_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from dapo import load_config, train\n"
        "def reward(response, ground_truth):\n"
        "    return 1.0\n"
        f"cfg = load_config('demo', [*{[f'model.path={tiny_model_dir}', f'run.dir={tmp_path}', *SMALL_OVERRIDES]!r}])\n"
        "train(cfg, reward_fn=reward, train_data=[{'problem': '1+1=', 'answer': '2'}])\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], env=env(), capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert out.returncode != 0
    assert (
        "a reward worker could not load the reward function: RuntimeError: dapo.train() was called while a reward "
        "worker ran your script to find its reward_fn; put the script's training code under "
        "if __name__ == '__main__':"
    ) in out.stderr, out.stderr[-3000:]


def test_the_pool_reads_numbers_and_pairs_and_refuses_the_rest():
    from dapo.rewards import Grade, RewardPool

    with RewardPool(num_workers=1, reward_fns={"reward_fn": user_rewards.numpy_scores}) as pool:
        result = pool.score(["x\nlast line ", "y"], ["pair", "1"], "reward_fn")
    # a pair gives score and flag; a lone number counts as right when > 0; the prediction is the last line
    assert result.grades == [Grade(0.5, False, "last line"), Grade(-0.25, False, "y")]
    for fn, returned in [(user_rewards.boolean, r"True \(bool\)"), (user_rewards.not_a_number, None)]:
        with RewardPool(num_workers=1, reward_fns={"reward_fn": fn}) as pool:
            message = (
                rf"^reward_fn returned {returned}; return a float score"
                if returned
                else r"^reward_fn returned the score nan; return a finite number$"
            )
            with pytest.raises(RewardFnError, match=message):
                pool.score(["x"], ["1"], "reward_fn")
