"""LoRA at scale: two FSDP ranks give the update of one, every rank's engine gets the merged weights, sharded
adapter checkpoints; vLLM sampling from the merged model, and training with it.

The 2-rank part runs this file as a torchrun worker, as tests/test_parallel.py does.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import loss_fn_of, make_policy, small_config, training_engine  # noqa: E402
from dapo import checkpoint  # noqa: E402
from dapo.checkpoint import shards as checkpoint_shards
from dapo.checkpoint import weights as checkpoint_weights  # noqa: E402
from dapo.checkpoint.weights import export_hf, is_lora  # noqa: E402
from dapo.model import lora
from dapo.reporting.run_log import read_metrics  # noqa: E402
from dapo.rollout import SamplingParams  # noqa: E402
from dapo.runtime import parallel
from test_lora import LORA, ONE_UPDATE, REPO, sampled  # noqa: E402


# ---- FSDP: 2 ranks vs 1 --------------------------------------------------------------------------
def fsdp_worker(model_dir: str, batch_file: str, out_dir: str) -> None:
    """Under torchrun: log-probs, one SGD update (lr 1: the change is minus the gradient), the reference
    with the adapters off, the merged push into every rank's engine, a sharded checkpoint and its reload."""
    from test_parallel import checksum

    d = parallel.init("cpu")
    out_dir = Path(out_dir)
    cfg = small_config(
        out_dir / "run", model_dir, *LORA, *ONE_UPDATE, "train.micro_batch_size=2", "model.gradient_checkpointing=true"
    )
    policy = make_policy(cfg, "cpu", d)
    policy.optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=1.0)
    engine = training_engine(cfg, policy, d)
    batch = torch.load(batch_file, weights_only=False)
    old_logp, _ = policy.compute_logprobs(batch)
    before = {k: v.clone() for k, v in parallel.full_tensors(policy.model.named_parameters())}
    stats = policy.update(batch, loss_fn_of(cfg))
    after = {k: v.clone() for k, v in parallel.full_tensors(policy.model.named_parameters())}
    ref_logp = policy.base_reference().logprobs(batch)
    merged = {k: v.clone() for k, v in policy.named_weights()}
    engine.update_weights(policy.named_weights())
    engine_weights = dict(engine.engine.model.named_parameters())  # this rank's full copy, a plain HF model
    engine_sums = parallel.all_gather_object({k: checksum(engine_weights[k]) for k in merged}, d)
    step = checkpoint.save_checkpoint(
        out_dir / "run",
        1,
        model=policy.model,
        tokenizer=policy.tokenizer,
        trainer_state={"policy": policy.trainer_state()},
        config_yaml="",
        keep=1,
        shards=policy.sharded_state(),
        dist=d,
    )
    reloaded = make_policy(cfg, "cpu", d)
    reloaded.optimizer = torch.optim.SGD([p for p in reloaded.model.parameters() if p.requires_grad], lr=1.0)
    checkpoint_weights.load_policy_weights(reloaded, step)
    reloaded_weights = {k: v.clone() for k, v in parallel.full_tensors(reloaded.model.named_parameters())}
    if d.is_main:
        torch.save(
            {
                "old_logp": old_logp,
                "ref_logp": ref_logp,
                "stats": {k: float(v) for k, v in stats.items()},
                "delta": {k: after[k] - before[k] for k in after},
                "after": after,
                "merged": merged,
                "engine_sums": engine_sums,
                "merged_sums": {k: checksum(v) for k, v in merged.items()},
                "reloaded": reloaded_weights,
            },
            out_dir / "two.pt",
        )
    parallel.shutdown(d)


@pytest.fixture(scope="module")
def two_rank_lora(tiny_model_dir, tmp_path_factory):
    from test_parallel import torchrun

    tmp = tmp_path_factory.mktemp("lora-fsdp")
    cfg = small_config(tmp / "single", tiny_model_dir, *LORA, *ONE_UPDATE, "train.micro_batch_size=2")
    torch.manual_seed(0)
    policy = make_policy(cfg)
    policy.optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=1.0)
    batch = sampled(policy)
    torch.save(batch, tmp / "batch.pt")
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    stats = {k: float(v) for k, v in policy.update(batch, loss_fn_of(cfg)).items()}
    single = {
        "old_logp": batch.old_logp,
        "stats": stats,
        "merged": dict(policy.named_weights()),
        "delta": {k: v.detach() - before[k] for k, v in policy.model.named_parameters()},
    }
    torchrun(__file__, "fsdp", tiny_model_dir, tmp / "batch.pt", tmp, timeout=400)
    return single, torch.load(tmp / "two.pt", weights_only=False), tmp


def test_two_ranks_with_lora_give_the_update_of_one(two_rank_lora):
    single, two, _ = two_rank_lora
    assert set(two["delta"]) == set(single["delta"])
    adapters = [k for k in single["delta"] if ".lora_" in k]
    scale = max(single["delta"][k].abs().max().item() for k in adapters)
    diff = max((two["delta"][k] - single["delta"][k]).abs().max().item() for k in adapters)
    print(f"\nLoRA, 1 vs 2 ranks: max |d update| {diff:.2e} of max |update| {scale:.3f}")
    assert scale > 1e-3 and diff < 1e-6
    assert all(
        torch.equal(two["delta"][k], torch.zeros_like(two["delta"][k])) for k in single["delta"] if k not in adapters
    )
    assert two["stats"]["pg_loss"] == pytest.approx(single["stats"]["pg_loss"], abs=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(single["stats"]["grad_norm"], rel=1e-5)
    assert (two["old_logp"] - single["old_logp"]).abs().max() < 1e-5
    # the sharded reference (adapters off) is the base, which the adapters were before the update (B = 0)
    assert (two["ref_logp"] - single["old_logp"]).abs().max() < 1e-5
    assert max((two["merged"][k] - v).abs().max().item() for k, v in single["merged"].items()) < 1e-6


def test_every_ranks_engine_gets_the_merged_weights(two_rank_lora):
    _, two, _ = two_rank_lora
    assert two["engine_sums"] == [two["merged_sums"]] * 2
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(two["merged"][f"{q}.weight"], two["after"][f"base_model.model.{q}.base_layer.weight"])


def test_sharded_lora_checkpoints_hold_the_adapters_reload_and_export(two_rank_lora, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    single, two, tmp = two_rank_lora
    step = tmp / "run" / "checkpoints" / "step_000001"
    assert checkpoint_weights.is_sharded(step) and is_lora(step) and not (step / "adapter" / lora.WEIGHTS_FILE).exists()
    assert all(torch.equal(two["reloaded"][k], v) for k, v in two["after"].items())  # adapters from the shards
    index = checkpoint_shards._safe_dcp_loaders(step / "shards")[0].read_metadata()
    saved = sorted(k.removeprefix("model.") for k in index.state_dict_metadata if k.startswith("model."))
    assert saved == sorted(k for k in two["after"] if ".lora_" in k)  # the adapters alone (not even the tied head)

    merged = AutoModelForCausalLM.from_pretrained(export_hf(step, tmp / "merged"))
    got = dict(merged.named_parameters())
    assert max((got[k] - v).abs().max().item() for k, v in two["merged"].items()) < 1e-6
    adapter = export_hf(step, tmp / "adapter", adapter=True)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    ours = {f"base_model.model.{k}" if not k.startswith("base_model.") else k: v for k, v in two["after"].items()}
    loaded = dict(peft_model.named_parameters())
    assert all(torch.equal(loaded[k], ours[k]) for k in ours if ".lora_" in k)


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


if __name__ == "__main__":  # the torchrun worker
    mode, *rest = sys.argv[1:]
    {"fsdp": fsdp_worker}[mode](*rest)
