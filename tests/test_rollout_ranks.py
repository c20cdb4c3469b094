"""Rollout ranks (rollout.ranks, with rollout.max_staleness > 0) under torchrun, gloo on CPU: the job's last ranks
only generate, the others train. Against the rollout process beside one trainer (the same schedule, the same seeds),
they sample the same tokens and train to the same weights; two rollout ranks sample the shares two synchronous
training ranks do; a resumed run ends on the uninterrupted run's weights; bad splits are refused in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_OVERRIDES, train_in_one_thread
from dapo.checkpoint import weights as checkpoint_weights
from dapo.config import ConfigError, load_config, validate
from dapo.runtime import parallel

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ["train.total_steps=3", "rollout.max_staleness=1", "algo.rollout_is_cap=2", "rollout.engine_threads=1"]
NO_EVAL = ["eval.benchmarks=[]"]  # the held-out evaluation after the last step: no test here reads it
# two-phase screening, on assets/arith-base (whose answers are sometimes right), with its room to answer
SCREEN = ["algo.dynamic_sampling=true", "algo.screen_samples=2", "rollout.max_response_tokens=48",
          "algo.overlong_buffer_tokens=8"]  # fmt: skip
LAUNCH_TIMEOUT_S = 600  # a launch takes up to about 150 s on a loaded 2-core machine


def env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def run(model_dir, run_dir: Path, *extra, nproc: int = 1, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *launch, "-m", "dapo.cli", "train", "configs/demo.yaml", *SMALL_OVERRIDES,
           f"model.path={model_dir}", f"run.dir={run_dir}", *extra]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


def rows(run_dir: Path) -> dict[int, dict]:
    lines = next(run_dir.glob("*/metrics.jsonl")).read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines)) if "rollout/response_length_mean" in r}


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s weights, from its model directory or, written by several ranks, its shards exported."""
    ckpt = next(run_dir.glob(f"*/checkpoints/step_{step:06d}"))
    if not any(ckpt.rglob("model*.safetensors")):
        ckpt = checkpoint_weights.export_hf(ckpt, run_dir / f"export_{step}")
    return load_file(next(ckpt.rglob("model*.safetensors")))


def one_process(model_dir, run_dir: Path, *extra) -> Path:
    """The reference: one trainer with its rollout process, on the same schedule and seeds, trained from this
    process (the launches' settings: one torch thread, configs/demo.yaml with the same overrides)."""
    train_in_one_thread(load_config("configs/demo.yaml", [*SMALL_OVERRIDES, f"model.path={model_dir}",
                                                          f"run.dir={run_dir}", *ASYNC, *NO_EVAL, *extra]))  # fmt: skip
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_a_trainer_and_a_rollout_rank_screen_and_train_as_the_rollout_process_does_and_resume_exactly(tmp_path):
    """2 ranks, 1 of them generating, with two-phase screening (n = 2 of G = 4) on the demo's base model (which
    answers some problems right, so prompts are both screened out and completed): the same screening counts, samples
    step by step and final weights, bit for bit, as the trainer with its rollout process; stopped after step 2
    (step 3's batch in flight) and started again, the same weights again."""
    model, a = ROOT / "assets" / "arith-base", tmp_path / "ranks"
    reference = one_process(model, tmp_path / "process", *SCREEN, "run.save_every=1")
    run(model, a, *ASYNC, *NO_EVAL, *SCREEN, "rollout.ranks=1", "run.save_every=1", nproc=2)
    ref, got = rows(reference), rows(a)
    assert all(ref[t]["sampling/groups_kept"] > 0 and ref[t]["sampling/screened"] > ref[t]["sampling/groups_kept"]
               for t in (1, 2, 3))  # fmt: skip
    assert [got[t]["async/staleness_max"] for t in (1, 2, 3)] == [0, 1, 1]
    for t in (1, 2, 3):  # the same tokens: the same screening, lengths, rewards and losses to the bit
        for key in ("sampling/screened", "sampling/screened_out_tokens", "sampling/samples_generated",
                    "rollout/response_length_mean", "critic/rewards/mean", "actor/pg_loss"):  # fmt: skip
            assert got[t][key] == ref[t][key], (t, key)
    for t in (1, 2, 3):  # each sample says which weights sampled it: version t - 1 - k, at least 0
        text = next(a.glob(f"*/samples/step_{t:06d}.md")).read_text()
        assert text.count(f"sampled by weights version {max(0, t - 2)})") == text.count("## sample") > 0
    w_ref, w = weights(reference, 3), weights(a, 3)
    assert all(torch.equal(w_ref[n], w[n]) for n in w_ref)
    shutil.rmtree(next(a.glob("*/checkpoints/step_000003")))  # as if killed after step 2's checkpoint
    run(model, a, *ASYNC, *NO_EVAL, *SCREEN, "rollout.ranks=1", "run.save_every=1", nproc=2)
    w_resumed = weights(a, 3)
    assert all(torch.equal(w_ref[n], w_resumed[n]) for n in w_ref)


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_two_training_ranks_beside_a_rollout_rank_train_on_the_same_samples(tiny_model_dir, tmp_path):
    """3 ranks at k = 2, 2 training with FSDP on the batches rank 0 collects through the third: the samples of the
    one-process run, and its weights up to the float noise of summing gradients over two ranks."""
    k, ranks = 2, tmp_path / "ranks"
    reference = one_process(tiny_model_dir, tmp_path / "process", f"rollout.max_staleness={k}", "run.save_every=3")
    run(tiny_model_dir, ranks, *ASYNC, *NO_EVAL, f"rollout.max_staleness={k}", "rollout.ranks=1", "run.save_every=3",
        nproc=3)  # fmt: skip
    ref, got = rows(reference), rows(ranks)
    for t in (1, 2, 3):
        assert got[t]["rollout/response_length_mean"] == ref[t]["rollout/response_length_mean"]
        assert got[t]["async/staleness_max"] == min(k, t - 1)
        assert abs(got[t]["actor/pg_loss"] - ref[t]["actor/pg_loss"]) < 1e-6
    w_ref, w = weights(reference, 3), weights(ranks, 3)
    gap = max((w_ref[n] - w[n]).abs().max().item() for n in w_ref)
    moved = max((w_ref[n] - load_file(next(tiny_model_dir.glob("model*.safetensors")))[n]).abs().max().item()
                for n in w_ref)  # fmt: skip
    print(f"\n2 training ranks vs 1: largest weight gap {gap:.2e}, training moved the weights by {moved:.2e}")
    assert gap < 1e-5 < moved


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_two_rollout_ranks_sample_the_shares_two_synchronous_ranks_do(tiny_model_dir, tmp_path):
    """Step 1 (version 0 on both sides): two rollout ranks split the prompts and seed their shares as two training
    ranks of the synchronous loop do, so the step's samples and loss are theirs."""
    run(tiny_model_dir, tmp_path / "sync", *NO_EVAL, "train.total_steps=1", nproc=2)
    run(tiny_model_dir, tmp_path / "ranks", *ASYNC, *NO_EVAL, "train.total_steps=1", "rollout.ranks=2", nproc=3)
    sync, ranks = rows(tmp_path / "sync")[1], rows(tmp_path / "ranks")[1]
    assert ranks["rollout/response_length_mean"] == sync["rollout/response_length_mean"]
    assert abs(ranks["actor/pg_loss"] - sync["actor/pg_loss"]) < 1e-6


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["rollout.ranks=1"], "1", r"rollout.ranks=1: the job has 1 rank \(WORLD_SIZE\), which leaves none to train"),
        (["rollout.ranks=2"], "2", r"rollout.ranks=2: the job has 2 ranks .*launch at least 3"),
    ],
)
def test_a_split_that_leaves_no_rank_to_train_is_refused_in_one_line(overrides, world, message):
    cfg = load_config("configs/demo.yaml", ["rollout.max_staleness=1", "algo.rollout_is_cap=2", *overrides])
    with pytest.raises(ConfigError, match=message):
        parallel.is_rollout_rank(cfg.rollout.ranks, env={"WORLD_SIZE": world, "RANK": "0"})


def test_the_last_ranks_are_the_rollout_ranks():
    job = {"WORLD_SIZE": "4"}
    assert [parallel.is_rollout_rank(1, env={**job, "RANK": str(r)}) for r in range(4)] == [False] * 3 + [True]
    assert [parallel.is_rollout_rank(0, env={**job, "RANK": str(r)}) for r in range(4)] == [False] * 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["rollout.ranks=1"], r"rollout.ranks=1: rollout ranks generate the next steps .*set rollout.max_staleness"),
        (
            ["rollout.ranks=1", "rollout.max_staleness=1", "algo.rollout_is_cap=2", "rollout.tensor_parallel_size=2"],
            r"rollout.ranks=1: .*rollout.tensor_parallel_size=2 across rollout ranks is not supported",
        ),
    ],
)
def test_rollout_ranks_without_staleness_or_split_by_tensor_parallelism_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("configs/demo.yaml", extra))


def test_several_training_ranks_without_rollout_ranks_are_told_to_give_it_some():
    """k > 0 with every rank of the job training: one line, pointing at rollout.ranks, from the config and the ranks
    alone, before any engine starts (what a torchrun launch of 2 such ranks stops with on rank 0)."""
    from dapo.collect.collector import build_collector

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was asked for before the refusal")

    cfg = load_config("configs/demo.yaml", ["rollout.max_staleness=1", "algo.rollout_is_cap=2"])
    with pytest.raises(ConfigError) as err:
        build_collector(cfg, parallel.Dist(rank=0, world_size=2), None, no_engine, no_engine)
    assert "\n" not in str(err.value)
    assert "rollout.max_staleness=1 with 2 training ranks: give the rollout ranks of its own, rollout.ranks=1" in str(
        err.value
    )
