"""rollout.max_staleness: the engine in a process of its own, collecting the next steps while the trainer updates.

The schedule (step t sampled by weights version max(0, t - 1 - k)), admission, what a checkpoint keeps in flight,
the rollout process's log-probs against the model's own forward, and whole runs at k = 1 and 2: the staleness each
step reports, and a run killed with SIGKILL and resumed ends on the weights of an uninterrupted one, bit for bit.
"""

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from conftest import SMALL_OVERRIDES
from dapo.collect.ahead import AheadThread
from dapo.config import ConfigError, dump_yaml, load_config
from dapo.reporting.run_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]


# ---- the schedule -----------------------------------------------------------------------------------------------
class FakeTrainer:
    """Publishes version t after 'training' step t; records which version each collection used and when."""

    def __init__(self, k: int, last: int, **kwargs):
        self.log: list[tuple[int, int, int]] = []  # (step, version, versions published when it started)
        self.ahead = AheadThread(self.collect, max_staleness=k, first=1, last=last, published=0, **kwargs)

    def collect(self, step: int, version: int):
        self.log.append((step, version, self.ahead._published))
        return f"batch {step}", None, {"after": step}

    def run(self, steps: range) -> list[str]:
        self.ahead.start()
        out = []
        for t in steps:
            collected, _ = self.ahead.take(t)
            out.append(collected.batch)
            time.sleep(0.01)  # the update
            self.ahead.release(t)
            self.ahead.publish(t)
        self.ahead.stop()
        return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_step_t_is_sampled_by_version_t_minus_1_minus_k_and_waits_for_it(k):
    trainer = FakeTrainer(k, last=8)
    assert trainer.run(range(1, 9)) == [f"batch {t}" for t in range(1, 9)]
    assert [(s, v) for s, v, _ in trainer.log] == [(t, max(0, t - 1 - k)) for t in range(1, 9)]
    assert all(published >= v for _, v, published in trainer.log)  # admission: never before its weights exist
    # never more than k + 1 steps ahead of the trainer: step t starts only once t - 1 - k is trained
    assert all(published >= s - 1 - k for s, _, published in trainer.log)


def test_a_checkpoint_keeps_the_collected_untrained_steps_and_a_resume_goes_on_from_them():
    k = 2
    first = FakeTrainer(k, last=6)
    first.ahead.start()
    for t in (1, 2):
        first.ahead.take(t)
        first.ahead.release(t)
        first.ahead.publish(t)
    in_flight = first.ahead.in_flight(2)
    assert [c.step for c in in_flight] == [3, 4] and [c.version for c in in_flight] == [0, 1]
    assert in_flight[-1].state == {"after": 4}
    first.ahead.stop()
    # a step taken, then abandoned before its update (a signal): it is in flight again for the checkpoint before it
    first_abandoned = FakeTrainer(k, last=6)
    first_abandoned.ahead.start()
    first_abandoned.ahead.take(1)
    assert [c.step for c in first_abandoned.ahead.in_flight(0)] == [1, 2]
    first_abandoned.ahead.stop()
    # resumed after step 2 with steps 3, 4 in flight: 5 and 6 are collected by versions 2 and 3, as uninterrupted
    resumed = FakeTrainer(k, last=6, ahead=in_flight)
    resumed.ahead._published = resumed.ahead.floor = 2
    assert resumed.run(range(3, 7)) == [f"batch {t}" for t in range(3, 7)]
    assert [(s, v) for s, v, _ in resumed.log] == [(5, 2), (6, 3)]


def test_a_failed_collection_reaches_the_trainer():
    def collect(step, version):
        raise RuntimeError(f"engine broke at step {step}")

    ahead = AheadThread(collect, max_staleness=1, first=1, last=3, published=0).start()
    with pytest.raises(RuntimeError, match="engine broke at step 1"):
        ahead.take(1)


def test_a_stop_ends_a_waiting_thread():
    ahead = FakeTrainer(1, last=5).ahead.start()
    ahead.take(1)  # steps 1, 2 collected; 3 waits for version 1, never published
    ahead.stop(timeout=5.0)
    assert not ahead._thread.is_alive()


# ---- the rollout process's log-probs ----------------------------------------------------------------------------
def test_the_hf_engine_reports_the_models_own_log_probs(tiny_model_dir):
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(model, tok, logprobs=True)
    prompts = [tok.encode("12+3="), tok.encode("what is 7*8 ? say it")]  # two lengths: the short one is padded
    gen = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=1))
    assert [len(lp) for lp in gen.logprobs] == [len(r) for r in gen.response_ids]
    for p, r, lp in zip(gen.prompt_ids, gen.response_ids, gen.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float() / 0.7  # alone, unpadded
        own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(lp), own, atol=1e-5), (lp, own.tolist())
    assert min(min(lp) for lp in gen.logprobs) < -0.1  # sampled tokens, not all near-certain


def test_the_rollout_process_samples_what_the_engine_in_process_does(tiny_model_dir):
    """Same weights, same seed: the same tokens, whichever process samples them. A SIGTERM or SIGINT sent to the
    whole job does not end the rollout process (the trainer's checkpoint waits on its collections in flight): it
    still answers."""
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.build import engine_of_its_own
    from dapo.rollout.hf import HFRolloutEngine
    from dapo.rollout.remote import RemoteEngine, RemoteEngineError

    cfg = load_config("configs/demo.yaml", [f"model.path={tiny_model_dir}"])
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    with torch.no_grad():  # weights other than the directory's: version 3 must be what samples
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=7)
    prompts = [tok.encode("1+2="), tok.encode("9*9=")]
    here = HFRolloutEngine(model, tok, logprobs=True).generate(prompts, params)
    remote = RemoteEngine(
        engine_of_its_own, cfg.rollout, cfg.model, tok, max_model_len=64, threads=torch.get_num_threads()
    )
    try:
        remote.update_weights(model.named_parameters(), version=3)
        remote.use_version(3)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(remote._proc.pid, sig)
        time.sleep(0.2)
        assert remote._proc.is_alive()
        there = remote.generate(prompts, params)
        assert there.response_ids == here.response_ids and there.texts == here.texts
        assert there.logprobs == here.logprobs
        pid = remote._proc.pid  # a rollout process that dies says so, whichever pipe finds it first
        os.kill(pid, signal.SIGKILL)
        gone = f"the rollout process (pid {pid}) was killed by SIGKILL while receiving weights; the run stops here: "
        with pytest.raises(RemoteEngineError, match=re.escape(gone) + "run the same command again to resume"):
            remote.update_weights(model.named_parameters(), version=4)
        with pytest.raises(RemoteEngineError, match=re.escape(f"(pid {pid}) was killed by SIGKILL while generating")):
            remote.generate(prompts, params)
    finally:
        remote.close()


# ---- whole runs -------------------------------------------------------------------------------------------------
def overrides(model_dir, run_dir, k, steps, *extra) -> list[str]:
    return [
        *SMALL_OVERRIDES,
        f"model.path={model_dir}",
        *([f"run.dir={run_dir}"] if run_dir else []),
        f"train.total_steps={steps}",
        f"rollout.max_staleness={k}",
        "algo.rollout_is_cap=2",
        *extra,
    ]


def rows_of(run_dir: Path) -> list[dict]:
    return read_metrics(next(run_dir.glob("*/metrics.jsonl")))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    last = sorted(run_dir.glob("*/checkpoints/step_*"))[-1]
    return load_file(next(last.rglob("model*.safetensors")))


def test_staleness_by_step_and_a_run_killed_with_sigkill_resumes_onto_the_uninterrupted_runs_weights(
    tiny_model_dir, tmp_path
):
    """k = 2: step t trains on responses exactly min(2, t - 1) versions old; killed anywhere (here after step 1's
    checkpoint, which holds steps 2 and 3 in flight, so the resumed run trains those and samples step 4 itself), the
    resumed run ends on the uninterrupted run's weights, bit for bit. Only the killed run needs a process of its own:
    the others run here (a run generating ahead sets the trainer's threads itself, in a process or not)."""
    from dapo.training import train

    k, steps = 2, 4
    args = overrides(tiny_model_dir, None, k, steps, "run.save_every=1", "run.keep_checkpoints=100")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train(load_config("configs/demo.yaml", [*args, f"run.dir={whole}"]))
    command = [sys.executable, "-m", "dapo.training", "configs/demo.yaml", *args, f"run.dir={killed}"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300  # start-up and one step take under a minute on 2 loaded cores
    while not list(killed.glob("*/checkpoints/step_000001")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its rollout process, wherever they were
    proc.wait()
    done = sorted(p.name for p in killed.glob("*/checkpoints/step_*"))
    assert done and done[-1] < f"step_{steps:06d}", f"the run finished before the kill: {done}"
    console = io.StringIO()  # a resume that started over would end on the same weights: it must say where from
    train(load_config("configs/demo.yaml", [*args, f"run.dir={killed}"]), console=Console(file=console, width=1000))
    assert f"resumed from {killed / 't' / 'checkpoints' / done[-1]} (step {int(done[-1][5:])})" in console.getvalue()
    rows = [r for r in rows_of(whole) if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [min(k, t - 1) for t in range(1, steps + 1)]
    # step 1 is sampled by the weights it trains: the rollout process's log-probs are the trainer's
    assert rows[0]["rollout/logprob_abs_diff_mean"] < 1e-6
    assert rows[0]["async/policy_kl"] < 1e-9 and rows[0]["rollout/is_ess"] == pytest.approx(1.0, abs=1e-6)
    # later steps by older weights: the importance weights correct for it, and are reported; the policy moved
    assert all(r["rollout/logprob_abs_diff_mean"] > 1e-4 and "rollout/is_weight_mean" in r for r in rows[1:])
    assert all(r["async/policy_kl"] > 1e-6 and r["rollout/is_ess"] < 1.0 for r in rows[1:])
    assert all(r["async/trainer_wait_s"] >= 0 and r["async/engine_wait_s"] >= 0 for r in rows)
    a, b = final_weights(whole), final_weights(killed)
    print(f"\nkilled after {done[-1]}; resumed to step {steps}")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    whole_rows = {r["step"]: r for r in rows_of(whole) if "async/staleness_max" in r}
    killed_rows = {r["step"]: r for r in rows_of(killed) if "async/staleness_max" in r}
    for step in range(int(done[-1][5:]) + 1, steps + 1):  # the steps trained after the resume: the same batches
        assert killed_rows[step]["rollout/response_length_mean"] == whole_rows[step]["rollout/response_length_mean"]
        assert killed_rows[step]["async/staleness_max"] == min(k, step - 1)


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_generating_ahead_alone_takes_the_default_cap_and_an_explicit_null_still_refuses(tmp_path):
    cfg = load_config("configs/demo.yaml", ["rollout.max_staleness=1"])
    assert cfg.algo.rollout_is_cap == 2.0 and "rollout_is_cap: 2.0" in dump_yaml(cfg)  # the resolved config says so
    assert (
        load_config("configs/demo.yaml", ["rollout.max_staleness=1", "algo.rollout_is_cap=3"]).algo.rollout_is_cap == 3
    )
    assert load_config("configs/demo.yaml").algo.rollout_is_cap is None  # synchronous: the reference's, off
    with pytest.raises(ConfigError, match="rollout.max_staleness=1: .*set algo.rollout_is_cap"):
        load_config("configs/demo.yaml", ["rollout.max_staleness=1", "algo.rollout_is_cap=null"])
    preset = tmp_path / "p.yaml"
    preset.write_text("base: " + str(ROOT / "configs/demo.yaml") + "\nalgo:\n  rollout_is_cap: null\n")
    with pytest.raises(ConfigError, match="set algo.rollout_is_cap"):  # null in a preset is explicit too
        load_config(preset, ["rollout.max_staleness=1"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algo.rollout_is_cap=null"], "rollout.max_staleness=1: .*set algo.rollout_is_cap"),
        (
            ["algo.held_over_max_groups=4"],
            "rollout.max_staleness=1: algo.held_over_max_groups=4 .*set algo.held_over_max_groups=0",
        ),
        (["algo.old_logp_source=engine"], "rollout.max_staleness=1: .*use algo.old_logp_source=recompute"),
    ],
)
def test_settings_that_cannot_bound_or_correct_the_staleness_are_refused_in_one_line(extra, message):
    from dapo.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(load_config("configs/demo.yaml", ["rollout.max_staleness=1", "algo.rollout_is_cap=2", *extra]))


def test_a_checkpoint_with_batches_in_flight_resumes_only_at_its_staleness(tiny_model_dir, tmp_path):
    """k = 1: steps 1, 2 are sampled 0, 1 versions old, steps without a batch included; the checkpoint after
    step 1 holds step 2's batch, which a run at k = 0 would not train: refused. (The staleness staying at k past
    step k + 1: the k = 2 run above.)"""
    from dapo.training import train

    # with dynamic sampling the tiny random model gets no group right: steps train nothing, and the run goes on
    # (each such step still hands the engine its version, the weights unchanged, which the next collection awaits);
    # one generation round a step is enough to come back empty
    run = overrides(tiny_model_dir, tmp_path, 1, 2, "run.save_every=1", "algo.dynamic_sampling=true")
    train(load_config("configs/demo.yaml", [*run, "algo.max_gen_rounds=1"]))
    rows = [r for r in rows_of(tmp_path) if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [0, 1]
    assert any("actor/pg_loss" not in r for r in rows), "every step trained: the no-batch case was not reached"
    shutil.rmtree(next(tmp_path.glob("*/checkpoints/step_000002")))  # as if stopped after step 1: step 2 in flight
    again = overrides(tiny_model_dir, tmp_path, 0, 2, "algo.rollout_is_cap=null")
    with pytest.raises(ConfigError, match="rollout.max_staleness=1; resume with that setting"):
        train(load_config("configs/demo.yaml", again))


def test_a_policy_moving_far_between_sampling_and_training_is_warned_of_once(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """A step size far past the demo's, one step stale: the mean policy KL of steps 2-3 is past the level
    (metrics.DRIFT_KL_LEVEL) and the run says so once (not again at step 4), naming the learning rate and k. The
    window is 2 steps here, not notes.DRIFT_WINDOW's 5: the window's own arithmetic is tests/test_metrics.py's; this
    is the run feeding it and printing its line."""
    from dapo.reporting import notes
    from dapo.training import train

    monkeypatch.setattr(notes, "DRIFT_WINDOW", 2)
    run = overrides(tiny_model_dir, tmp_path, 1, 4, "train.lr=0.05", "train.warmup_steps=0")
    train(load_config("configs/demo.yaml", run))
    rows = [r for r in rows_of(tmp_path) if r.get("async/staleness_max")]
    assert sum(r["async/policy_kl"] for r in rows[:2]) / 2 > notes.DRIFT_KL_LEVEL
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    said = [line for line in out.split("step ")[1:] if "the policy moves far between sampling and training" in line]
    assert len(said) == 1 and "lower train.lr (now 0.05) or rollout.max_staleness (now 1)" in said[0], said


def test_the_pipeline_at_zero_staleness_samples_and_trains_as_the_synchronous_loop(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The machinery alone: the rollout process, the collecting thread and the checkpointed collection state, with
    each step sampled by the weights it trains (version t - 1, as k = 0), give the synchronous run's samples step
    by step and its final weights up to float noise (the importance weight is then pi_old / pi_engine, two
    forwards of the same weights: 1 within 1e-6). So what k > 0 changes is the staleness, and nothing else."""
    from dapo.collect.ahead import AheadThread
    from dapo.training import train

    torch.set_num_threads(1)  # each side one thread, as the rollout process and the trainer get on 2 cores
    # two steps: the second is sampled by the weights the first pushed to the rollout process
    common = ["rollout.engine_threads=1"]
    sync = tmp_path / "sync"
    train(load_config("configs/demo.yaml", overrides(tiny_model_dir, sync, 0, 2, *common, "algo.rollout_is_cap=null")))
    torch.set_num_threads(1)
    monkeypatch.setattr(AheadThread, "version_for", lambda self, step: step - 1)
    piped = tmp_path / "piped"
    train(load_config("configs/demo.yaml", overrides(tiny_model_dir, piped, 1, 2, *common)))
    a, b = rows_of(sync), rows_of(piped)
    for ra, rb in zip(a, b):  # the same responses, graded the same, every step
        for key in ("rollout/response_length_mean", "rollout/acc_mean", "sampling/tokens_generated"):
            assert ra[key] == rb[key], (ra["step"], key)
    assert all(abs(r["rollout/is_weight_mean"] - 1) < 1e-6 and r["async/staleness_max"] == 0 for r in b)
    wa, wb = final_weights(sync), final_weights(piped)
    assert max((wa[n] - wb[n]).abs().max().item() for n in wa) < 1e-5
