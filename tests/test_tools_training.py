"""The Python tool in training: tool tokens are context only (the loss and gradient equal the hand-masked ones, no
tool token's engine log-prob enters a ratio), a training run with the tool grades the final answer and trains the
model's own tokens, void turns counted and filtered only when asked."""

import math

import pytest
import torch

from conftest import loss_fn_of, make_policy, objective_loss, small_config
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.rollout_correction import MODES
from dapo.algorithm.step import importance_weights
from dapo.config import AlgoConfig
from dapo.reporting.metrics import step_metrics
from test_tools import TOK, ArithToolUser, needs_bwrap


def masked_batch(policy):
    """Three groups sampled from the tiny policy, with tokens 2-4 of every odd row marked as a tool's output."""
    from conftest import sampled_batch

    batch = sampled_batch(policy)
    batch.tool_mask = [
        [int(i % 2 == 1 and 2 <= t <= 4) for t in range(len(r))] for i, r in enumerate(batch.response_ids)
    ]
    return batch


def hand_mask(batch) -> torch.Tensor:
    """The same mask built by hand: valid response tokens, minus tokens 2-4 of odd rows."""
    T = batch.max_response_len
    mask = torch.zeros(len(batch), T)
    for i, r in enumerate(batch.response_ids):
        for t in range(len(r)):
            mask[i, t] = 0.0 if (i % 2 == 1 and 2 <= t <= 4) else 1.0
    return mask


def test_tool_tokens_are_context_only_loss_and_gradient_equal_the_hand_masked_ones(tiny_model_dir, tmp_path):
    from conftest import sgd
    from dapo.model.logprobs import token_logprobs
    from dapo.model.micro_batch import make_micro_batch

    cfg = small_config(
        tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=3", "train.grad_clip=1e9"
    )
    torch.manual_seed(0)
    policy = make_policy(cfg)
    sgd(policy)  # plain SGD at lr 1: the step is minus the gradient
    batch = masked_batch(policy)
    mask = hand_mask(batch)
    assert torch.equal(batch.response_mask(), mask)
    assert mask.sum() < batch.response_lengths.sum()  # some tokens are the tool's
    # old log-probs are computed over the whole sequence: the tool's tokens too (they are the model's context)
    mb = make_micro_batch(batch, list(range(len(batch))), policy.pad_id, "cpu")
    full, _ = token_logprobs(policy.model.eval(), mb, temperature=cfg.rollout.temperature)
    assert torch.allclose(batch.old_logp, full.detach(), atol=1e-6)
    assert batch.old_logp[1, 2:5].abs().min() > 0
    # expected: DAPO's loss on the hand-masked batch in one pass, and its gradient
    logp, _ = token_logprobs(policy.model.train(), mb, temperature=cfg.rollout.temperature)
    loss, _ = objective_loss("dapo", logp, batch.old_logp, batch.adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    loss.backward()
    expected = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = policy.update(batch, loss_fn_of(cfg))
    assert stats["pg_loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    for p, b, g in zip(policy.model.parameters(), before, expected):
        assert torch.allclose(b - p.detach(), g, atol=1e-6)
    assert max(g.abs().max() for g in expected) > 1e-3
    # the entropy metric averages the model's tokens only
    cstats = __import__("dapo.collect.stats", fromlist=["CollectStats"]).CollectStats()
    m = step_metrics(batch, cstats, {}, {"update": 1.0, "old_logprob": 1.0})
    assert m["actor/entropy"].item() == pytest.approx(float((batch.entropy * mask).sum() / mask.sum()), rel=1e-6)


def test_no_tool_tokens_engine_log_prob_enters_a_ratio(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir)
    torch.manual_seed(0)
    batch = masked_batch(make_policy(cfg))
    mask = hand_mask(batch)
    engine = (batch.old_logp - 0.01 * torch.rand_like(batch.old_logp)).tolist()  # the engine's, close to the trainer
    results = []
    for garbage in (0.0, 40.0, -40.0):  # what the rollout wrote on the tool's tokens: must change nothing
        batch.rollout_logp = [
            [garbage if tool else lp for lp, tool in zip(row[: len(tm)], tm)]
            for row, tm in zip(engine, batch.tool_mask)
        ]
        per_mode = {}
        for mode in MODES:
            stats = importance_weights(batch, AlgoConfig(rollout_is_cap=2.0, rollout_is_mode=mode))
            per_mode[mode] = (batch.is_weights * mask, {k: float(v) for k, v in stats.items()})
        cstats = __import__("dapo.collect.stats", fromlist=["CollectStats"]).CollectStats()
        m = step_metrics(batch, cstats, {}, {"update": 1.0, "old_logprob": 1.0})
        results.append((per_mode, float(m["rollout/logprob_abs_diff_max"])))
    for per_mode, diff_max in results[1:]:
        assert diff_max == results[0][1] < 0.011
        for mode, (weights, stats) in per_mode.items():
            assert torch.equal(weights, results[0][0][mode][0]), mode
            assert stats == results[0][0][mode][1], mode
    # and the sequence ratio is the product over the model's tokens only: row 1, by hand
    rho = math.exp(
        sum((batch.old_logp[1, t] - engine[1][t]).item() for t in range(len(batch.response_ids[1])) if mask[1, t])
    )
    importance_weights(batch, AlgoConfig(rollout_is_cap=1e9, rollout_is_mode="sequence_truncate"))
    assert batch.is_weights[1, 0].item() == pytest.approx(rho, rel=1e-5)


@needs_bwrap
def test_a_training_run_with_the_tool_grades_the_final_answer_and_trains_the_models_tokens(
    tiny_model_dir, tmp_path, monkeypatch
):
    import dapo.rollout.build
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    monkeypatch.setattr(dapo.rollout.build, "engine_on", lambda *a, **k: ArithToolUser())
    cfg = small_config(
        tmp_path, tiny_model_dir, "tools.python=true", "rollout.max_response_tokens=64", "algo.dynamic_sampling=true"
    )
    train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert len(rows) == 2
    for m in rows:
        assert m["tools/calls_per_response"] == 1.0 and m["tools/turns_per_response"] == 2.0
        assert m["tools/errors_per_response"] == 0.0 and m["tools/tokens_masked"] > 0
        assert m["reward/acc_mean"] == 0.5  # the grader read each response's final answer
        assert m["sampling/tokens_trained"] == m["sampling/tokens_generated"] - m["tools/tokens_masked"]
    sample = (cfg.run_dir / "samples").glob("*")
    text = "".join(p.read_text() for p in sample)
    assert "```output" in text and "Answer:" in text  # the samples show each turn


@needs_bwrap
def test_void_turns_are_counted_and_filtered_only_when_asked(tiny_model_dir, tmp_path, monkeypatch):
    import dapo.rollout.build
    from dapo.algorithm.step import assign_advantages
    from dapo.config import ConfigError
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    class Voids(ArithToolUser):  # rows 0 mod 4 close a text block (void), rows 1 mod 4 stop without an answer
        @staticmethod
        def write(prompt, row, call):
            text = TOK.decode(prompt)
            if "```" not in text:
                return "```text\nhmm\n```\n" if row % 4 == 0 else "I give up.<eos>" if row % 4 == 1 else (
                    f"```python\nprint({text.split('=')[0]})\n```\n")  # fmt: skip
            if "```output" not in text:
                return "Answer: 0<eos>"
            value = int(text.split("```output\n")[-1].split("\n")[0])
            return f"Answer: {value + row % 2}<eos>"

    monkeypatch.setattr(dapo.rollout.build, "engine_on", lambda *a, **k: Voids())
    for flag in ("false", "true"):
        cfg = small_config(
            tmp_path / flag, tiny_model_dir, "tools.python=true", "rollout.max_response_tokens=64",
            f"tools.filter_void_turns={flag}", "train.total_steps=1",
        )  # fmt: skip
        train(cfg)
        (m,) = read_metrics(cfg.run_dir)
        assert m["tools/void_turn_frac"] == 0.5  # rows 0 and 1 of every 4
        assert (m["sampling/tokens_trained"] < m["sampling/tokens_generated"] - m["tools/tokens_masked"]) == (
            flag == "true"
        )
    batch = RolloutBatch.of_responses(
        [[1]] * 2, [[5, 6]] * 2, group_size=2, reward=torch.tensor([1.0, -1.0]), void_turn=[True, False]
    )
    assign_advantages(batch, cfg.algo, 2, filter_void_turns=True)
    assert batch.trainable.tolist() == [False, True] and batch.adv.tolist() == pytest.approx(
        [0.7071, -0.7071], abs=1e-4
    )
    with pytest.raises(ConfigError, match="tools.filter_void_turns=true: .* needs tools.python=true"):
        small_config(tmp_path, tiny_model_dir, "tools.filter_void_turns=true")
