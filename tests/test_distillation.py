"""On-policy distillation: a frozen teacher's log-prob of every sampled token gives it the advantage term
coef x (log p_teacher - log p_student), beside the reward's advantage or alone (teacher.*)."""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import SMALL_OVERRIDES, sampled_batch, small_config
from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import teacher_term
from dapo.config import ConfigError, TeacherConfig, load_config


def perturbed_copy(model_dir, out):
    """``model_dir``'s model with every weight moved by seeded noise, and its tokenizer: another distribution over
    the same token ids."""
    from dapo.model.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def demo_teacher_dir(tmp_path_factory):
    """The demo's base model, perturbed: the demo's tokenizer, another distribution."""
    return perturbed_copy("assets/arith-base", tmp_path_factory.mktemp("demo-teacher"))


def teacher_of(cfg):
    from dapo.model.policy import Policy
    from dapo.model.teacher import TeacherModel

    student = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    teacher = TeacherModel(
        cfg.teacher, cfg.model, cfg.train, student_tokenizer=student.tokenizer,
        temperature=cfg.rollout.temperature, device=torch.device("cpu"),
    )  # fmt: skip
    return student, teacher


@pytest.mark.parametrize(
    "tokenizer,layout",
    [
        ("tiny", []),
        ("tiny", ["train.share_prompt_prefix=true"]),
        ("tiny", ["train.max_tokens_per_micro_batch=40"]),
        ("smollm2", ["train.max_tokens_per_micro_batch=40"]),
    ],
)
def test_the_teacher_s_log_probs_are_its_own_full_forward_at_the_sampling_temperature(
    tiny_model_dir, teacher_dir, request, tmp_path, layout, tokenizer
):
    """Sampled rows of the student, scored by the teacher over the student's micro-batch layout (one pass, shared
    prompts, several micro-batches): each token's log-prob is log_softmax(logits / T) of the teacher's own forward
    over the whole sequence, to float32 precision; with the character tokenizer and with SmolLM2's real BPE one."""
    student_dir, teacher = (
        (tiny_model_dir, teacher_dir) if tokenizer == "tiny" else request.getfixturevalue("real_tokenizer_dirs")
    )
    cfg = load_config(
        "configs/demo.yaml",
        [f"model.path={student_dir}", *SMALL_OVERRIDES, f"teacher.path={teacher}", "teacher.coef=1"]
        + ["rollout.temperature=0.7", *layout],
    )
    student, teacher = teacher_of(cfg)
    batch = sampled_batch(student)
    got = teacher.logprobs(batch)  # (N, T)
    for i in range(len(batch)):
        prompt, response = batch.prompt_ids[i], batch.response_ids[i]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = teacher.model(ids).logits[0].float() / 0.7  # (L, V)
        want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None])[:, 0]
        torch.testing.assert_close(got[i, : len(response)], want, rtol=0, atol=2e-6)
        assert not got[i, len(response) :].any()  # nothing past a response's end
    assert not torch.equal(got, student.compute_logprobs(batch)[0])  # another model: other log-probs


def test_the_advantage_with_the_teacher_term_by_hand():
    """Two responses of one group, rewards +1 and -1 (eq. 9: +0.7071 and -0.7071), three token positions, the
    second response two tokens long. coef = 0.5; the term is 0.5 x (teacher - student) per token, none on padding."""
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.0, -1.5], [-1.2, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    reward_adv = advantages.group_advantages(torch.tensor([1.0, -1.0]), 2)
    both, term = advantages.teacher_advantages(reward_adv, teacher, student, mask, coef=0.5)
    want_term = torch.tensor([[0.25, 0.0, -0.5], [-0.5, 1.0, 0.0]])
    torch.testing.assert_close(term, want_term)
    a = 1 / 2**0.5 / (1 + 1e-6 * 2**0.5)  # (1 - 0) / (std 1.4142 + eps), as group_advantages computes it
    torch.testing.assert_close(both, torch.tensor([[a + 0.25, a, a - 0.5], [-a - 0.5, -a + 1.0, -a]]))
    alone, _ = advantages.teacher_advantages(None, teacher, student, mask, coef=0.5)
    torch.testing.assert_close(alone, want_term)  # pure distillation: the term alone


class ScoredBy:
    """A teacher whose log-probs are given."""

    def __init__(self, logp):
        self.logp = logp

    def logprobs(self, batch):
        return self.logp


def test_the_teacher_term_scores_only_the_model_s_own_tokens_and_its_statistics_by_hand():
    """Two responses, the second three tokens of which the middle one a tool wrote: that token gets no term and
    counts in no statistic. reverse KL per token = student - teacher: [0.5, -1] and [1, (tool), 0.5]."""
    batch = RolloutBatch.of_responses(
        [[1], [1]], [[5, 6], [7, 8, 9]], group_size=2, reward=torch.tensor([1.0, -1.0]), tool_mask=[[0, 0], [0, 1, 0]]
    )
    batch.adv = advantages.group_advantages(batch.reward, 2)  # (+a, -a)
    batch.old_logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -9.0, -1.0]])
    teacher = ScoredBy(torch.tensor([[-1.5, -1.0, 0.0], [-1.5, -0.1, -1.5]]))
    a = float(batch.adv[0])
    stats = teacher_term(batch, teacher, TeacherConfig(path="t", coef=2.0))
    torch.testing.assert_close(batch.adv, torch.tensor([[a - 1.0, a + 2.0, 0.0 + a], [-a - 2.0, -a, -a - 1.0]]))
    assert float(stats["teacher/reverse_kl_mean"]) == pytest.approx((0.5 - 1.0 + 1.0 + 0.5) / 4)
    assert float(stats["teacher/reverse_kl_response_mean"]) == pytest.approx(((0.5 - 1.0) / 2 + 1.5 / 2) / 2)
    term_abs, reward_abs = 1.0 + 2.0 + 2.0 + 1.0, 4 * a
    assert float(stats["teacher/adv_share"]) == pytest.approx(term_abs / (term_abs + reward_abs))
    batch.adv = advantages.group_advantages(batch.reward, 2)
    stats = teacher_term(batch, teacher, TeacherConfig(path="t", coef=2.0, reward_advantage=False))
    torch.testing.assert_close(batch.adv, torch.tensor([[-1.0, 2.0, 0.0], [-2.0, 0.0, -1.0]]))
    assert float(stats["teacher/adv_share"]) == 1.0


def test_pure_distillation_trains_every_group_where_dynamic_sampling_would_drop_them(
    tiny_model_dir, teacher_dir, tmp_path
):
    """The random tiny student answers nothing right: every group is all wrong, so DAPO's filter keeps none. Pure
    distillation (algo.dynamic_sampling=true given, as the demo's preset does) drops none, trains every step on all
    P groups in one round, and its advantage is the teacher's alone."""
    from dapo.training import train
    from test_async_rollout import rows_of

    teach = [f"teacher.path={teacher_dir}", "teacher.coef=1", "teacher.reward_advantage=false"]
    train(small_config(tmp_path / "pure", tiny_model_dir, "algo.dynamic_sampling=true", *teach))
    rows = [r for r in rows_of(tmp_path / "pure") if "sampling/groups_kept" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["sampling/groups_dropped"] == 0 and r["sampling/groups_kept"] == 4 and r["sampling/gen_rounds"] == 1
        assert r["reward/acc_mean"] == 0 and r["teacher/adv_share"] == 1.0 and r["sampling/tokens_trained"] > 0
        assert r["teacher/reverse_kl_mean"] != 0
    train(small_config(tmp_path / "dapo", tiny_model_dir, "algo.dynamic_sampling=true", "algo.max_gen_rounds=1"))
    assert all(r.get("sampling/groups_kept", 0) == 0 for r in rows_of(tmp_path / "dapo"))  # DAPO: nothing to train


def test_the_teacher_is_frozen_on_the_trainer_and_outside_the_optimizer_and_the_checkpoint(
    tiny_model_dir, teacher_dir, tmp_path
):
    import contextlib

    from dapo import training

    cfg = small_config(tmp_path, tiny_model_dir, f"teacher.path={teacher_dir}", "teacher.coef=1", "run.save_every=1")
    with contextlib.ExitStack() as stack:
        run = training.start(cfg, stack)
        before = {k: v.clone() for k, v in run.teacher.model.state_dict().items()}
        student_before = {k: v.clone() for k, v in run.policy.model.state_dict().items()}
        metrics, _ = training.train_step(run, 1)
        run.saver.wait()
        teacher_params = list(run.teacher.model.parameters())
        assert all(not p.requires_grad and p.grad is None for p in teacher_params)
        assert not run.teacher.model.training
        optimized = {id(p) for g in run.policy.optimizer.param_groups for p in g["params"]}
        assert optimized and not optimized & {id(p) for p in teacher_params}
        assert all(torch.equal(before[k], v) for k, v in run.teacher.model.state_dict().items())
        assert any(not torch.equal(student_before[k], v) for k, v in run.policy.model.state_dict().items())
        assert metrics["perf/time_teacher_logprob_s"] > 0 and "teacher/reverse_kl_mean" in metrics
    saved = sum(f.stat().st_size for f in (tmp_path / "t" / "checkpoints").rglob("*") if f.is_file())
    model_bytes = sum(p.numel() * 4 for p in run.policy.model.parameters())
    assert saved < 4 * model_bytes  # weights, AdamW's two moments and the small state: no teacher


def test_a_run_with_a_teacher_resumes_onto_the_uninterrupted_run_s_weights(demo_teacher_dir, tmp_path):
    """The demo's base model taught by a perturbed copy of itself (DAPO + teacher), 3 steps, checkpoint each step.
    Stopped after step 2's checkpoint, the resumed run ends on the uninterrupted run's weights, bit for bit, and
    logs the same teacher figures for step 3."""
    from dapo.training import train
    from test_async_rollout import final_weights, rows_of

    args = [*SMALL_OVERRIDES, "model.path=assets/arith-base", "algo.dynamic_sampling=true"]
    args += [f"teacher.path={demo_teacher_dir}", "teacher.coef=0.5"]
    args += ["train.total_steps=3", "run.save_every=1", "run.keep_checkpoints=10"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(load_config("configs/demo.yaml", [*args, f"run.dir={whole}"]))
    train(load_config("configs/demo.yaml", [*args, f"run.dir={cut}"]))
    shutil.rmtree(next(cut.glob("*/checkpoints/step_000003")))
    train(load_config("configs/demo.yaml", [*args, f"run.dir={cut}"]))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = [r for r in rows_of(whole) if r.get("step") == 3 and "teacher/reverse_kl_mean" in r][-1]
    again = [r for r in rows_of(cut) if r.get("step") == 3 and "teacher/reverse_kl_mean" in r][-1]
    assert last["teacher/reverse_kl_mean"] == again["teacher/reverse_kl_mean"]
    assert 0 < last["teacher/adv_share"] < 1


FULL = "teacher.signal=full"


@pytest.mark.parametrize(
    "extra",
    [
        ["model.lora.rank=4", "train.lr=1e-2"],
        ["rollout.max_staleness=1", "rollout.engine_threads=1"],
        ["train.share_prompt_prefix=true", "teacher.dtype=bfloat16"],
        ["model.lora.rank=4", "train.lr=1e-2", "train.share_prompt_prefix=true", "teacher.dtype=bfloat16", FULL],
    ],
    ids=["lora", "generated-ahead", "shared-prompt-prefix-bf16-teacher", "full-lora-shared-prompt-prefix-bf16-teacher"],
)
def test_a_teacher_composes_with_what_touches_the_trained_batch(demo_teacher_dir, tmp_path, extra):
    """Two steps each, the teacher's figures logged beside the other mechanism's, finite, on every trained step."""
    from dapo.training import train
    from test_async_rollout import rows_of

    args = [*SMALL_OVERRIDES, "model.path=assets/arith-base", f"teacher.path={demo_teacher_dir}", "teacher.coef=1"]
    train(load_config("configs/demo.yaml", [*args, *extra, f"run.dir={tmp_path}"]))
    rows = [r for r in rows_of(tmp_path) if "sampling/tokens_trained" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["teacher/reverse_kl_mean"] == pytest.approx(r["teacher/reverse_kl_mean"])  # finite, not nan
        if FULL in extra:  # the exact KL, from the update
            assert r["teacher/reverse_kl_mean"] > 0 and "teacher/adv_share" not in r
        else:
            assert 0 < r["teacher/adv_share"] <= 1 and r["perf/time_teacher_logprob_s"] > 0


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    from dapo import cli
    from dapo.model import tiny

    tokenizer = tiny.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    model = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=1)
    tiny.save(model, tokenizer, tmp_path / "wider")
    args = [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", *SMALL_OVERRIDES, "teacher.coef=1"]
    assert cli.main(["train", "configs/demo.yaml", *args, f"teacher.path={tmp_path / 'wider'}"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the tiny model's own saving lines
    assert err.startswith(f"error: teacher.path={tmp_path / 'wider'}: its tokenizer differs from model.path=")
    assert "259 tokens against 258, 1 with different ids" in err and "the student's tokenizer" in err


@pytest.mark.parametrize(
    "where,says",
    [
        ("missing", "error: teacher.path='{path}': no such directory"),
        ("empty", "error: teacher.path='{path}' is not a Hugging Face model directory (no config.json"),
    ],
)
def test_a_teacher_directory_that_cannot_load_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys, where, says):
    from dapo import cli

    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    args = [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", *SMALL_OVERRIDES, "teacher.coef=1"]
    assert cli.main(["train", "configs/demo.yaml", *args, f"teacher.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says.format(path=path)) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "extra,says",
    [
        (["teacher.coef=1"], "teacher.coef=1: the teacher's term needs a teacher; set teacher.path"),
        (["teacher.coef=-1"], "teacher.coef=-1.0: must be >= 0; 0 turns the teacher off"),
        (["teacher.reward_advantage=false"], "teacher.reward_advantage=false leaves the teacher's term as the only"),
        (["teacher.dtype=float16"], "teacher.dtype='float16': choose float32 or bfloat16"),
    ],
)
def test_bad_teacher_settings_are_refused_in_one_line_naming_the_field(extra, says):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", extra)
    assert str(err.value).startswith(says), str(err.value)


def test_prompts_are_cut_to_what_a_teacher_with_a_shorter_context_holds(tiny_model_dir, tmp_path):
    """The teacher scores every trained sequence whole: a teacher holding 64 positions (the student 512) caps the
    prompts at 64 less a training response, in a line naming teacher.path; a response that fills the teacher's
    context alone is refused in one line naming both."""
    from dapo.config import ConfigError
    from dapo.model import tiny
    from dapo.run_setup import setup_prompt_limit

    short = tmp_path / "short-teacher"
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64, seed=1)
    tiny.save(model, tokenizer, short)
    cfg = small_config(tmp_path, tiny_model_dir, "teacher.coef=1", f"teacher.path={short}")
    student, teacher = teacher_of(cfg)
    capped, line = setup_prompt_limit(cfg, student, teacher)
    assert capped.data.max_prompt_tokens == 64 - 16 and setup_prompt_limit(cfg, student)[0].data.max_prompt_tokens > 64
    assert line == (
        f"teacher.path={short}: data.max_prompt_tokens={cfg.data.max_prompt_tokens:,} capped at 48: the model holds "
        "64 tokens, 16 of them for the response (rollout.max_response_tokens)"
    )
    long = small_config(tmp_path, tiny_model_dir, "teacher.coef=1", f"teacher.path={short}",
                        "rollout.max_response_tokens=64", "algo.overlong_buffer_tokens=8")  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^teacher.path={short}: rollout.max_response_tokens=64: responses that "
                       "long fill the model's context of 64 tokens"):  # fmt: skip
        setup_prompt_limit(long, student, teacher)


def test_teacher_coef_0_loads_no_teacher_whatever_the_path(tiny_model_dir, tmp_path):
    import contextlib

    from dapo import training

    cfg = small_config(tmp_path, tiny_model_dir)
    assert cfg.teacher.coef == 0 and cfg.teacher.path is None
    with contextlib.ExitStack() as stack:
        assert training.start(cfg, stack).teacher is None
    cfg = small_config(tmp_path, tiny_model_dir, "teacher.path=not/there", "run.resume=false", "run.overwrite=true")
    with contextlib.ExitStack() as stack:  # coef 0 with a path (an ablation's DAPO row): still no teacher
        assert training.start(cfg, stack).teacher is None


def test_the_distillation_rows_of_dapo_ablate_and_the_demo_preset(tmp_path):
    """`dapo ablate --rows-dir configs/distillation teacher.path=DIR`: DAPO (no teacher), pure distillation, DAPO
    with the teacher and pure distillation on the teacher's full KL, each on the ablation's base;
    configs/demo_distill.yaml is the demo with its trained teacher."""
    from dapo.ablate import ROW_LABELS, find_rows, plan

    rows = find_rows(Path("configs/distillation"))
    _, runs = plan(Path("configs/ablation/base.yaml"), rows, [0], tmp_path, ["teacher.path=runs/demo/teacher"])
    by_row = {run.row: run.cfg.teacher for run in runs}
    assert list(by_row) == ["1_dapo", "2_distill", "3_dapo_teacher", "4_distill_full"]
    assert all(r in ROW_LABELS for r in by_row)
    assert by_row["1_dapo"].coef == 0
    assert by_row["2_distill"].coef == 1 and not by_row["2_distill"].reward_advantage
    assert by_row["3_dapo_teacher"].coef == 1 and by_row["3_dapo_teacher"].reward_advantage
    full = by_row["4_distill_full"]
    assert (full.coef, full.reward_advantage, full.signal) == (1, False, "full") and by_row[
        "2_distill"
    ].signal == "sampled"
    cfg = load_config("configs/demo_distill.yaml")
    assert (cfg.teacher.path, cfg.teacher.coef, cfg.teacher.reward_advantage) == ("runs/demo/teacher", 1.0, False)
    assert (cfg.teacher.signal, cfg.train.ppo_epochs, cfg.train.warmup_steps) == ("full", 4, 0)
    assert cfg.model.path == load_config("configs/demo.yaml").model.path


@pytest.mark.slow
def test_two_fsdp_ranks_shard_the_teacher_score_every_row_and_grade_with_the_configs_function(
    tiny_model_dir, teacher_dir, tmp_path
):
    """Under torchrun the teacher is sharded over the trainer's ranks as the policy is, and runs inside the update
    (teacher.signal=full: each micro-batch's forward gathers its layers on both ranks, a rank without rows joining
    with an empty pass): the run trains and logs the teacher's KL. (The sampled signal's teacher pass is the old
    log-probs' sharded pass, tests/test_parallel.py, on the teacher's weights.) The
    same launch grades with reward.function, a file of the user's (every response right, score 0.25): the ranks'
    grading workers and the held-out evaluation at the end use the function from their config."""
    import json

    from test_parallel import torchrun
    from test_reward_function import REWARDS

    (tmp_path / "my_rewards.py").write_text(REWARDS)
    args = ["-m", "dapo.cli", "train", "configs/demo.yaml", f"model.path={tiny_model_dir}", *SMALL_OVERRIDES]
    args += [f"teacher.path={teacher_dir}", "teacher.coef=1", "teacher.signal=full"]
    args += [f"reward.function={tmp_path / 'my_rewards.py'}:quarter"]
    torchrun(*args, f"run.dir={tmp_path}")
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in rows if "teacher/reverse_kl_mean" in r]
    # the teacher's KL beside the reward's advantage (whose scores differ within a group by the overlong penalty)
    assert len(train_rows) == 2
    assert all(r["teacher/reverse_kl_mean"] > 0 and "teacher/adv_share" not in r for r in train_rows)
    for r in train_rows:  # each response the function's 0.25 and right, plus its overlong penalty
        assert r["rollout/acc_mean"] == 1.0 and r["reward/score_max"] == 0.25
        assert r["reward/score_mean"] == pytest.approx(0.25 + r["reward/overlong_penalty_mean"], abs=1e-6)
    assert rows[-1]["eval/arith/avg@2"] == 1.0


@pytest.mark.sandbox
def test_a_teacher_composes_with_multi_turn_tool_rollouts(tmp_path):
    """The tools demo's model, taught by a perturbed copy of itself: responses call the sandboxed tool, and the
    teacher's figures are logged over the model's own tokens (a tool's output gets no term: the hand-computed test
    above)."""
    from dapo.training import train
    from test_async_rollout import rows_of

    teacher = perturbed_copy("assets/arith-tools-base", tmp_path / "teacher")
    args = [*SMALL_OVERRIDES, "model.path=assets/arith-tools-base", "rollout.max_response_tokens=64"]
    args += [f"teacher.path={teacher}", "teacher.coef=1", f"run.dir={tmp_path / 'runs'}"]
    train(load_config("configs/demo_tools.yaml", args))
    rows = [r for r in rows_of(tmp_path / "runs") if "sampling/tokens_trained" in r]
    assert len(rows) == 2 and sum(r.get("tools/calls_per_response", 0) for r in rows) > 0
    assert all(r["teacher/reverse_kl_mean"] != 0 and 0 < r["teacher/adv_share"] < 1 for r in rows)
