"""Two-phase screening (algo.screen_samples) on hand-made reward streams: what each prompt cost, what trained."""

import pytest
import torch

from conftest import SMALL_OVERRIDES
from dapo.algorithm import advantages
from dapo.collect.dynamic_sampling import DynamicSampling
from dapo.collect.scoring import Scored
from dapo.collect.stats import screen_metrics
from dapo.config import AlgoConfig, ConfigError, load_config
from dapo.reporting.run_log import _generation_line, run_summary
from dapo.rollout.base import Generation, SamplingParams
from test_dynamic_sampling import Ex, ListOrder

G = 4


class StreamEngine:
    """Prompt k's j-th response (over the whole run, across calls) is the text "k:j"; every call is recorded as
    the list of (prompt, responses asked for)."""

    def __init__(self):
        self.calls: list[list[tuple[int, int]]] = []
        self.given: dict[int, int] = {}

    def generate(self, prompt_ids, params):
        rows = [p for p in prompt_ids for _ in range(params.n)]
        asked: list[tuple[int, int]] = []
        for p in rows:
            if asked and asked[-1][0] == p[0]:
                asked[-1] = (p[0], asked[-1][1] + 1)
            else:
                asked.append((p[0], 1))
        self.calls.append(asked)
        texts = []
        for p in rows:
            j = self.given.get(p[0], 0)
            self.given[p[0]] = j + 1
            texts.append(f"{p[0]}:{j}")
        responses = [[1, 2, 3] for _ in rows]  # 3 tokens each
        return Generation(rows, responses, torch.zeros(len(rows), dtype=torch.bool), texts)


def stream_scorer(streams):
    """Response "k:j" is right iff streams[k][j] is 1."""

    def score(texts, gts, sources, lengths, truncated):
        acc = torch.tensor([float(streams[int(t.split(":")[0])][int(t.split(":")[1])]) for t in texts])
        return Scored(acc, acc * 2 - 1, torch.zeros_like(acc), ["x"] * len(texts))

    return score


def collect(streams, *, num_prompts, group_size=G, **algo_settings):
    cfg = AlgoConfig(**({"screen_samples": 2} | algo_settings))
    engine = StreamEngine()
    sampling = DynamicSampling(
        engine=engine,
        prompts=ListOrder([Ex(str(k), "x") for k in range(len(streams))]),
        scorer=stream_scorer(streams),
        encode=lambda ex: [int(ex.uid)],
        sampling=SamplingParams(n=group_size),
        algo=cfg,
    )
    batch, stats, _ = sampling.fill_batch(num_prompts, [], round_seed=lambda k: k)
    return batch, stats, engine


def test_a_call_mixing_continuations_and_screening_of_other_sizes_keeps_each_prompts_rows():
    """G = 6, n = 2: a continuation asks for 4 responses beside screenings of 2, in one call of single requests."""
    streams = [[0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    batch, stats, engine = collect(streams, num_prompts=2, group_size=6)
    # call 1: prompts 0, 1 (1 in); call 2: prompt 1's 4 more beside prompt 2's screening (in); call 3: prompt 2's
    # 4 more, alone
    assert engine.calls == [[(0, 2), (1, 2)], [(1, 4), (2, 2)], [(2, 4)]]
    assert batch.group_size == 6 and batch.example_uids == ["1"] * 6 + ["2"] * 6
    assert batch.acc.tolist() == [1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]


def test_a_prompt_whose_first_n_agree_costs_n_and_one_that_disagrees_is_completed_and_trained_over_all_g():
    streams = [
        [1, 1, 0, 0],  # agrees on its first 2 (both right): dropped after 2, though all 4 would have been informative
        [1, 0, 1, 1],  # disagrees: completed to 4
        [0, 0, 0, 0],  # all wrong: dropped after 2
        [0, 1, 0, 0],  # disagrees: completed
    ]
    batch, stats, engine = collect(streams, num_prompts=2, oversample=2.0)
    # call 1 screens 4 prompts (2 wanted, over-sampled 2x) with 2 responses each; call 2 completes the 2 that
    # disagreed with 2 more each (nothing is short any more, so nothing new is screened beside them)
    assert engine.calls == [[(0, 2), (1, 2), (2, 2), (3, 2)], [(1, 2), (3, 2)]]
    assert engine.given == {0: 2, 1: 4, 2: 2, 3: 4}
    assert batch.group_size == G and batch.example_uids == ["1"] * 4 + ["3"] * 4
    assert batch.acc.tolist() == [1, 0, 1, 1, 0, 1, 0, 0]  # the stream, in order: first 2, then the 2 more
    # eq. 9 over all 4 of each group: prompt 1's mean reward 0.5, prompt 3's -0.5
    adv = advantages.group_advantages(batch.reward, G)
    expected_1 = (torch.tensor([1.0, -1, 1, 1]) - 0.5) / (torch.tensor([1.0, -1, 1, 1]).std() + 1e-6)
    assert torch.allclose(adv[:4], expected_1, atol=1e-5)
    s = stats.screen
    assert (s.screened, s.out_all_correct, s.out_all_wrong, s.completed, s.out_tokens) == (4, 1, 1, 2, 12)
    assert (stats.samples_generated, stats.tokens_generated, stats.rounds) == (12, 36, 2)
    assert (stats.groups_dropped, stats.groups_all_correct, stats.groups_all_wrong) == (2, 1, 1)
    m = screen_metrics(s, group_size=G, screen_samples=2)
    assert m["sampling/screen_saved_tokens"] == 12.0  # 2 prompts x 2 responses not generated x 3 tokens


def test_the_continuation_rides_with_the_next_screening_and_surplus_prompts_are_not_completed():
    streams = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1]] + [[0, 0]] * 4
    # 3 groups wanted, adaptive over-sampling off: call 1 screens 3 (0, 1, 2): one in (1), 2 short; call 2 completes
    # prompt 1 and screens 3, 4 (both in); call 3 completes them, alone
    batch, stats, engine = collect(streams, num_prompts=3)
    assert engine.calls == [[(0, 2), (1, 2), (2, 2)], [(1, 2), (3, 2), (4, 2)], [(3, 2), (4, 2)]]
    assert batch.example_uids == ["1"] * 4 + ["3"] * 4 + ["4"] * 4
    # over-sampled 2x in call 1: 6 screened, 4 pass (1, 3, 4, 5), 3 are needed: prompt 5 is surplus, never completed
    batch, stats, engine = collect(streams, num_prompts=3, oversample=2.0)
    assert engine.calls == [[(k, 2) for k in range(6)], [(1, 2), (3, 2), (4, 2)]]
    assert engine.given[5] == 2 and stats.screen.surplus == 1 and stats.screen.surplus_tokens == 6


def test_the_audit_completes_screened_out_prompts_without_training_them():
    streams = [[1, 1, 0, 1], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    batch, stats, engine = collect(streams, num_prompts=1, screen_audit=1.0, oversample=4.0)
    # prompts 0, 2, 3 are screened out, and all three are completed to audit; only prompt 1 trains
    assert engine.calls == [[(k, 2) for k in range(4)], [(0, 2), (1, 2), (2, 2), (3, 2)]]
    assert batch.example_uids == ["1"] * 4
    s = stats.screen
    assert (s.audited, s.audit_informative, s.audit_tokens) == (3, 1, 18)  # only prompt 0's 4 would have taught
    rows = [{"sampling/tokens_generated": 48, "sampling/tokens_trained": 12, "sampling/dropped_gen_s": 0.0,
             "perf/time_generate_s": 1.0} | screen_metrics(s, group_size=G, screen_samples=2)]  # fmt: skip
    assert _generation_line(rows).endswith(
        "screening dropped 3 of 4 prompts after their first responses, saving about 18 tokens (27% of what "
        "complete groups would have cost); of 3 dropped prompts completed to audit, 1 would have been informative"
    )


def test_the_cap_stops_new_screening_but_completes_what_was_screened_in():
    streams = [[0, 0, 0, 0], [1, 0, 1, 0]] + [[0, 0, 0, 0]] * 8
    with pytest.warns(RuntimeWarning, match="max_gen_rounds=2 with 1/2 prompts kept"):
        batch, stats, engine = collect(streams, num_prompts=2, max_gen_rounds=2)
    # call 1: prompt 1 in, 1 short; call 2: its completion and prompt 2 screened (out); the cap: no call 3
    assert engine.calls == [[(0, 2), (1, 2)], [(1, 2), (2, 2)]]
    assert batch.example_uids == ["1"] * 4 and stats.cap_hit
    # at a cap of 1, prompt 1 was screened in by the one call the cap allows: completed past it, nothing new drawn
    with pytest.warns(RuntimeWarning, match="max_gen_rounds=1 with 1/2 prompts kept"):
        batch, stats, engine = collect(streams, num_prompts=2, max_gen_rounds=1)
    assert engine.calls == [[(0, 2), (1, 2)], [(1, 2)]] and batch.example_uids == ["1"] * 4


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["algo.screen_samples=1"],
            "algo.screen_samples=1: screening drops a prompt whose first n responses agree",
        ),
        (["algo.screen_samples=8"], "from 2 to rollout.group_size - 1 = 7"),
        (["algo.screen_samples=2", "algo.dynamic_sampling=false"], "with algo.dynamic_sampling=true"),
        (["algo.screen_audit=0.1"], "algo.screen_audit=0.1: audits the prompts screening drops; set"),
    ],
)
def test_settings_screening_cannot_honour_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/demo.yaml", extra)


# the settings of the runs below: the demo's base model (about 30% right), screening at n = 2 of G = 4
SCREENING = [*SMALL_OVERRIDES, "model.path=assets/arith-base", "rollout.max_response_tokens=48"]
SCREENING += ["algo.overlong_buffer_tokens=8", "algo.dynamic_sampling=true", "algo.screen_samples=2"]
# generating ahead: the rollout process screens and completes step t + 1's prompts while step t trains
AHEAD = [*SCREENING, "rollout.max_staleness=1", "rollout.engine_threads=1"]
AHEAD += ["train.total_steps=4", "run.save_every=1", "run.keep_checkpoints=10"]


@pytest.fixture(scope="module")
def generated_ahead(tmp_path_factory):
    """A run generating ahead with screening, never interrupted (4 steps): what a killed run must resume onto, and
    the generated-ahead case of the compositions."""
    from dapo.training import train

    run_dir = tmp_path_factory.mktemp("generated-ahead")
    train(load_config("configs/demo.yaml", [*AHEAD, f"run.dir={run_dir}"]))
    return run_dir


def test_a_screening_run_trains_says_what_it_saved_and_resumes_onto_the_same_weights(tmp_path):
    """Screening with an audit, 4 steps. Prompts are screened out and completed, every step trains, and the run's
    last line says what screening saved. Stopped after step 2's checkpoint (a copy of the run with steps 3 and 4
    removed, as a kill mid-step leaves them), the resumed run ends on the uninterrupted run's weights, bit for
    bit. (That a fresh run repeats another's steps: tests/test_train.py's resume.)"""
    import io
    import shutil

    from rich.console import Console

    from dapo.training import train
    from test_async_rollout import final_weights, rows_of

    args = [*SCREENING, "algo.screen_audit=0.5", "train.total_steps=4", "run.save_every=1", "run.keep_checkpoints=10"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(load_config("configs/demo.yaml", [*args, f"run.dir={whole}"]))
    out = " ".join(run_summary(rows_of(whole), wall_s=1.0, run_dir=whole))
    rows = [r for r in rows_of(whole) if "sampling/screened" in r]
    assert len(rows) == 4 and all(r["sampling/tokens_trained"] > 0 for r in rows)  # every step trained
    assert all(r["sampling/screened"] > r["sampling/groups_kept"] > 0 for r in rows)
    assert sum(r["sampling/screened_out_all_correct"] + r["sampling/screened_out_all_wrong"] for r in rows) > 0
    assert "screening dropped" in out and "completed to audit" in out, out[-600:]
    shutil.copytree(whole, cut)
    for step in (3, 4):
        shutil.rmtree(next(cut.glob(f"*/checkpoints/step_{step:06d}")))
    console = io.StringIO()  # a resume that started over would end on the same weights: it must say where from
    train(load_config("configs/demo.yaml", [*args, f"run.dir={cut}"]), console=Console(file=console, width=1000))
    assert f"resumed from {cut / 't' / 'checkpoints' / 'step_000002'} (step 2)" in console.getvalue()
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("configs/demo.yaml", AHEAD[len(SCREENING) :]),
        ("configs/demo.yaml", ["train.share_prompt_prefix=true"]),
        ("configs/demo.yaml", ["model.lora.rank=4", "train.lr=1e-2"]),
        pytest.param(
            "configs/demo_tools.yaml",
            ["model.path=assets/arith-tools-base", "rollout.max_response_tokens=64"],
            marks=pytest.mark.sandbox,
        ),
    ],
    ids=["generated-ahead", "shared-prompt-prefix", "lora", "python-tool"],
)
def test_screening_composes_with_what_touches_a_group(tmp_path, preset, extra, request):
    """Two steps each (generating ahead: the 4 of the run the killed run below resumes onto): the step logs its
    screening beside the other mechanism's own figures, and what it generated is n responses per prompt screened
    and G - n per prompt completed."""
    from dapo.training import train
    from test_async_rollout import rows_of

    if "rollout.max_staleness=1" in extra:
        run_dir, steps = request.getfixturevalue("generated_ahead"), 4
    else:
        run_dir, steps = tmp_path, 2
        train(load_config(preset, [*SCREENING, *extra, f"run.dir={tmp_path}"]))
    rows = [r for r in rows_of(run_dir) if "sampling/screened" in r]
    assert len(rows) == steps and all(r["sampling/tokens_trained"] > 0 for r in rows)
    # what was generated: n for each prompt screened, G - n more for each completed (training or audit)
    for r in rows:
        completed = r["sampling/groups_kept"] + r["sampling/screen_audited"]
        assert r["sampling/samples_generated"] == 2 * r["sampling/screened"] + (4 - 2) * completed
    if "rollout.max_staleness=1" in extra:
        assert all(r["async/staleness_max"] == min(1, r["step"] - 1) for r in rows)
    if preset.endswith("demo_tools.yaml"):
        assert sum(r.get("tools/calls_per_response", 0) for r in rows) > 0


@pytest.mark.slow
def test_a_run_generating_ahead_killed_while_its_rollout_process_screens_resumes_onto_the_same_weights(
    generated_ahead, tmp_path
):
    """rollout.max_staleness=1: the rollout process screens and completes step t + 1's prompts while step t trains.
    SIGKILL to both right after step 2's checkpoint (the next collection, its screenings and continuations, in
    flight), then the same command: the final weights are the uninterrupted run's, bit for bit. Only the killed
    run is a process of its own; the uninterrupted run and the resume run here (a run generating ahead sets the
    trainer's threads itself, in a process or not)."""
    import io
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rich.console import Console

    from dapo.training import train
    from test_async_rollout import final_weights, rows_of

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    whole, killed = generated_ahead, tmp_path / "killed"
    command = [sys.executable, "-m", "dapo.training", "configs/demo.yaml", *AHEAD, f"run.dir={killed}"]
    proc = subprocess.Popen(command, cwd=root, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300  # start-up and two steps take about a minute on 2 loaded cores
    while not list(killed.glob("*/checkpoints/step_000002")) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in killed.glob("*/checkpoints/step_*"))
    assert done and done[-1] < "step_000004", f"the run finished before the kill: {done}"
    console = io.StringIO()  # a resume that started over would end on the same weights: it must say where from
    train(load_config("configs/demo.yaml", [*AHEAD, f"run.dir={killed}"]), console=Console(file=console, width=1000))
    assert f"resumed from {killed / 't' / 'checkpoints' / done[-1]} (step {int(done[-1][5:])})" in console.getvalue()
    rows = [r for r in rows_of(whole) if "sampling/screened" in r]
    assert len(rows) == 4 and all(r["sampling/screened"] > r["sampling/groups_kept"] > 0 for r in rows)
    assert rows[-1]["async/staleness_max"] == 1
    a, b = final_weights(whole), final_weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
