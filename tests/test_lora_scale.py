"""LoRA with vLLM: sampling from the merged model after a push, and training with it (two FSDP ranks with LoRA against
one process, every rank's engine getting the merged weights and sharded adapter checkpoints: tests/test_parallel.py,
in its launch of two ranks)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import loss_fn_of, make_policy, small_config  # noqa: E402
from dapo.model import lora
from dapo.reporting.run_log import read_metrics  # noqa: E402
from dapo.rollout import SamplingParams  # noqa: E402
from test_lora import LORA, REPO  # noqa: E402


# ---- vLLM ----------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_samples_from_the_merged_model_after_a_push(tmp_path):
    """After an update of the adapters, the merged weights pushed into vLLM give the trainer's log-probs
    (the peft model with its adapters on). The model is assets/arith-base: vLLM's CPU attention has no
    kernel for the conftest model's 16-wide heads."""
    from dapo.algorithm import advantages
    from dapo.algorithm.batch import RolloutBatch
    from dapo.rollout.build import engine_on
    from test_vllm import LOGP_TOL_MAX, LOGP_TOL_MEAN, VLLM_OVERRIDES, logp_abs_diff

    model = REPO / "assets" / "arith-base"
    cfg = small_config(tmp_path, model, *VLLM_OVERRIDES, *LORA, "rollout.temperature=0.7")
    policy = make_policy(cfg)
    engine = engine_on(cfg.rollout, policy.model, policy.tokenizer)
    prompts = [policy.tokenizer(p)["input_ids"] for p in ("2+7*4=", "9=", "7-")]
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=24, seed=1)
    gen = engine.generate(prompts, params)
    start = logp_abs_diff(policy, gen, 4)
    assert start.mean() < LOGP_TOL_MEAN  # B = 0: the peft model is the base vLLM loaded
    batch = RolloutBatch.from_generation(gen, group_size=4)
    batch.reward = torch.tensor([1.0 if "Answer" in t and i % 2 else -1.0 for i, t in enumerate(gen.texts)])
    batch.adv = advantages.group_advantages(batch.reward, 4)
    batch.old_logp, _ = policy.compute_logprobs(batch)
    for group in policy.optimizer.param_groups:
        group["lr"] = 2e-2
    for _ in range(2):
        policy.update(batch, loss_fn_of(cfg))
    stale = logp_abs_diff(policy, engine.generate(prompts, params), 4)
    engine.update_weights(policy.named_weights())
    fresh = logp_abs_diff(policy, engine.generate(prompts, params), 4)
    print(
        f"\nLoRA push: vLLM vs trainer |diff| mean {fresh.mean():.2e} max {fresh.max():.2e} "
        f"(before the push {stale.mean():.2e})"
    )
    assert stale.mean() > 1e-2  # the adapters moved the policy
    assert fresh.mean() < LOGP_TOL_MEAN and fresh.max() < LOGP_TOL_MAX


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_two_lora_training_steps_with_vllm_and_a_kl_term(tmp_path):
    """The loop pushes the merged weights after step 1, so step 2 samples from the trained adapters (a failed
    push would show as a large log-prob gap); the KL term's reference is the base, which step 2 has left."""
    from dapo.training import train
    from test_vllm import LOGP_TOL_MAX, LOGP_TOL_MEAN, VLLM_OVERRIDES

    cfg = small_config(
        tmp_path, REPO / "assets" / "arith-base", *VLLM_OVERRIDES, *LORA, "train.lr=1e-2", "algo.kl_coef=0.01"
    )
    train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff_mean"] < LOGP_TOL_MEAN and r["rollout/logprob_abs_diff_max"] < LOGP_TOL_MAX
    assert rows[1]["actor/kl_loss"] > 0
    assert (cfg.run_dir / "checkpoints" / "step_000002" / "adapter" / lora.WEIGHTS_FILE).is_file()
