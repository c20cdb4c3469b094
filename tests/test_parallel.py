"""FSDP on CPU for real: 2 gloo ranks under torchrun against 1 process, full-parameter and with LoRA adapters,
sharded checkpoints and their export, the weights pushed to every rank's rollout engine (Ray: tests/test_ray.py; a
torchrun run resumed from its shards, bit for bit: tests/test_preemption.py; the rows' partition and the rendezvous
store: tests/test_rank_setup.py).

The 2-rank parts run this file as a torchrun worker (``python -m torch.distributed.run ... this
file``), the way a user launches training.
"""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES, loss_fn_of, make_policy, small_config  # noqa: E402
from dapo import checkpoint, cli  # noqa: E402
from dapo.algorithm.step import first_update_rows  # noqa: E402
from dapo.checkpoint import shards as checkpoint_shards
from dapo.checkpoint import weights as checkpoint_weights
from dapo.checkpoint.weights import export_hf, is_lora  # noqa: E402
from dapo.model import lora  # noqa: E402
from dapo.rollout import SamplingParams  # noqa: E402
from dapo.runtime import parallel

REPO = Path(__file__).resolve().parents[1]
EQUIV_OVERRIDES = [
    "train.prompts_per_step=3",
    "train.mini_batch_prompts=3",
    "train.micro_batch_size=2",
    "train.grad_clip=1e9",
]  # one optimizer update; no clipping, so the update is the gradient


def checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def env_for_children(**extra) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    return env


def torchrun(*args, timeout=300, cwd=REPO, check=True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]
    out = subprocess.run(cmd, cwd=cwd, env=env_for_children(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 or not check, out.stdout[-3000:] + out.stderr[-5000:]
    return out


# ---- 2 ranks vs 1 --------------------------------------------------------------------------------
# bf16: FSDP's mixed precision with fp32 masters; uneven: rank 0 runs one row per micro-batch, so
# rank 1 has fewer micro-batches and must run empty passes to join rank 0's collectives
# shared: train.share_prompt_prefix, each rank computing its prompts once (the decoder runs twice per pass)
VARIANTS = {
    "fp32": ([], False),
    "bf16": (["model.dtype=bfloat16"], False),
    "uneven": ([], True),
    "shared": (["train.share_prompt_prefix=true"], False),
    "shared_uneven": (["train.share_prompt_prefix=true", "train.micro_batch_size=null"], True),
    # the update's forward gives every row's old log-probs (one update: the pass computes none), each rank its own
    "from_update_uneven": (["algo.old_logp_from_update=true"], True),
}


def equivalence_worker(model_dir: str, batch_file: str, out_dir: str) -> None:
    """Run under torchrun: per variant, log-probs and one SGD update (lr 1, so the change is minus
    the gradient) on the batch the test sampled; then push the weights to every rank's engine,
    save shards, and sample with the sharded engine; then the same with LoRA adapters (``lora_update``); last, the
    automatic resume of the run whose checkpoint the
    test crafted (``crafted_resume``)."""
    d = parallel.init("cpu")
    for name, (overrides, uneven) in VARIANTS.items():
        one_update(d, model_dir, batch_file, Path(out_dir) / f"{name}.pt", Path(out_dir) / name, overrides, uneven)
    lora_update(d, model_dir, Path(out_dir) / "lora_batch.pt", Path(out_dir) / "lora")
    crafted_resume(d, model_dir, Path(out_dir))
    parallel.shutdown(d)


def crafted_resume(d, model_dir: str, out_dir: Path) -> None:
    """Run under torchrun: the automatic resume a training run starts with (``run_setup.setup_resume``) in the run
    whose only step directory the test crafted (``craft_checkpoint``); each rank writes the reason it stopped with,
    the line the CLI prints, to crafted.<rank>.txt."""
    from dapo.run_setup import setup_resume
    from dapo.runtime.files import CheckpointError

    cfg = small_config(out_dir / "crafted", model_dir)
    policy = make_policy(cfg, "cpu", d)
    try:
        setup_resume(cfg, d, policy, None, None)  # refused before the engine or the collector is used
        line = "resumed"
    except CheckpointError as err:
        line = str(err)
    (out_dir / f"crafted.{d.rank}.txt").write_text(line)


def craft_checkpoint(run_root: Path, marker: Path) -> None:
    """A step directory whose shards/.metadata pickles os.system (touching ``marker``), in run ``run_root``/t."""
    import pickle

    from test_checkpoint import RunsCommand

    step = run_root / "t" / "checkpoints" / "step_000001"
    (step / "shards").mkdir(parents=True)
    torch.save({"step": 1}, step / "trainer_state.pt")
    (step / "shards" / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))


def save_step_1(policy, run_dir: Path, d) -> Path:
    """Step 1's checkpoint of ``policy`` in ``run_dir``, sharded over the ranks."""
    return checkpoint.save_checkpoint(
        run_dir,
        1,
        model=policy.model,
        tokenizer=policy.tokenizer,
        trainer_state={"policy": policy.trainer_state()},
        config_yaml="",
        keep=1,
        shards=policy.sharded_state(),
        dist=d,
    )


def one_update(d, model_dir, batch_file, out_file, run_dir, overrides, uneven) -> None:
    from conftest import training_engine

    cfg = small_config(run_dir, model_dir, *EQUIV_OVERRIDES, *overrides)
    policy = make_policy(cfg, "cpu", d)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    if uneven and d.rank == 0:
        policy.micro_batches = lambda batch, rows: [[r] for r in rows]
    engine = training_engine(cfg, policy, d)
    batch = torch.load(batch_file, weights_only=False)
    share = policy._rank_rows(batch, list(range(len(batch))))  # the batch is one mini-batch here
    counts = parallel.all_gather_object(len(policy.micro_batches(batch, share)), d)  # micro-batches per rank
    from_update = first_update_rows(batch, policy) if cfg.algo.old_logp_from_update else []
    old_logp, entropy = policy.compute_logprobs(batch, with_entropy=True, skip=from_update)
    if from_update:  # as the step does: the pass's rows (here none: one update), and the update fills the others
        assert not old_logp.any()
        batch.old_logp, batch.entropy = old_logp, entropy
    before = {k: v.clone() for k, v in policy.named_weights()}
    stats = policy.update(batch, loss_fn_of(cfg), old_logp_rows=from_update)
    after = {k: v.clone() for k, v in policy.named_weights()}
    if from_update:
        old_logp, entropy = batch.old_logp, batch.entropy
    engine.update_weights(policy.named_weights())
    save_step_1(policy, Path(run_dir), d)
    engine_weights = dict(engine.engine.model.named_parameters())  # this rank's full copy
    engine_sums = parallel.all_gather_object({k: checksum(engine_weights[k]) for k in after}, d)
    # each rank samples a share of the prompts; every rank gets all of them, in prompt order
    prompts = [policy.tokenizer(t)["input_ids"] for t in ("1+2=", "3*4-5=", "6+7*2=")]
    gen = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3))
    gens = parallel.all_gather_object((gen.prompt_ids, gen.response_ids, gen.truncated.tolist()), d)
    if d.is_main:
        torch.save(
            {
                "old_logp": old_logp,
                "entropy": entropy,
                "stats": {k: float(v) for k, v in stats.items()},
                "delta": {k: after[k] - before[k] for k in after},
                "after": after,
                "engine_sums": engine_sums,
                # the engine runs in model.dtype: the trainer's float32 masters rounded to it
                "trainer_sums": {k: checksum(v.to(engine_weights[k].dtype)) for k, v in after.items()},
                "prompts": prompts,
                "gens": gens,
                "counts": counts,
            },
            out_file,
        )


@pytest.fixture(scope="module")
def two_rank_update(tiny_model_dir, tmp_path_factory):
    from conftest import sampled_batch

    tmp = tmp_path_factory.mktemp("equiv")
    cfg = small_config(tmp / "single", tiny_model_dir, *EQUIV_OVERRIDES)
    torch.manual_seed(0)
    policy = make_policy(cfg)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    batch = sampled_batch(policy)  # 3 prompts x 4 samples, old log-probs from this single process
    torch.save(batch, tmp / "batch.pt")
    before = {k: v.clone() for k, v in policy.named_weights()}
    stats = {k: float(v) for k, v in policy.update(batch, loss_fn_of(cfg)).items()}
    single = {
        "old_logp": batch.old_logp,
        "entropy": batch.entropy,
        "stats": stats,
        "delta": {k: v - before[k] for k, v in policy.named_weights()},
    }
    craft_checkpoint(tmp / "crafted", tmp / "pwned")
    lora_reference(tiny_model_dir, tmp)
    t0 = time.perf_counter()
    torchrun(__file__, "equivalence", tiny_model_dir, tmp / "batch.pt", tmp)
    runs = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in VARIANTS}
    return single, runs, tmp, time.perf_counter() - t0


def test_two_ranks_give_the_loss_and_gradients_of_one(two_rank_update):
    single, runs, _, seconds = two_rank_update
    two = runs["fp32"]
    logp_diff = (two["old_logp"] - single["old_logp"]).abs().max().item()
    grad_diff = max((two["delta"][k] - single["delta"][k]).abs().max().item() for k in single["delta"])
    grad_scale = max(v.abs().max().item() for v in single["delta"].values())
    loss_diff = abs(two["stats"]["pg_loss"] - single["stats"]["pg_loss"])
    print(
        f"\n1 vs 2 ranks: max |d loss| {loss_diff:.2e} (loss {single['stats']['pg_loss']:.6f}), "
        f"max |d grad| {grad_diff:.2e} (max |grad| {grad_scale:.3f}), max |d logp| {logp_diff:.2e}, "
        f"grad norm {single['stats']['grad_norm']:.6f} vs {two['stats']['grad_norm']:.6f}; torchrun {seconds:.1f} s"
    )
    assert set(two["delta"]) == set(single["delta"])
    assert grad_scale > 1e-3  # the update did something
    assert grad_diff < 1e-6  # summed over ranks, not averaged: a factor 2 would show here
    assert loss_diff < 1e-6
    assert two["stats"]["grad_norm"] == pytest.approx(single["stats"]["grad_norm"], rel=1e-5)
    assert logp_diff < 1e-5
    assert (two["entropy"] - single["entropy"]).abs().max().item() < 1e-4
    for k in ("clipfrac_high", "clipfrac_low", "approx_kl", "token_prob_mean"):
        assert two["stats"][k] == pytest.approx(single["stats"][k], abs=1e-6), k


def test_bfloat16_compute_keeps_float32_master_weights(two_rank_update, tiny_model_dir):
    """FSDP's mixed precision on 2 ranks (bf16 forward/backward, fp32 reduce and masters) against
    the fp32 single process: the same update up to bfloat16 rounding."""
    single, runs, _, _ = two_rank_update
    bf16 = runs["bf16"]
    assert all(v.dtype == torch.float32 for v in bf16["after"].values())  # the master copy
    scale = max(v.abs().max().item() for v in single["delta"].values())
    grad_diff = max((bf16["delta"][k] - single["delta"][k]).abs().max().item() for k in single["delta"])
    print(
        f"\nbf16 compute, 2 ranks vs fp32, 1 rank: max |d grad| {grad_diff:.2e} of max |grad| {scale:.3f}; "
        f"loss {bf16['stats']['pg_loss']:.6f} vs {single['stats']['pg_loss']:.6f}"
    )
    assert 0 < grad_diff < 0.02 * scale  # bf16 keeps ~3 significant digits; fp32 compute would give ~1e-8
    assert bf16["stats"]["pg_loss"] == pytest.approx(single["stats"]["pg_loss"], abs=1e-4)
    assert bf16["engine_sums"] == [bf16["trainer_sums"]] * 2


def test_two_ranks_taking_old_log_probs_from_the_update_give_those_of_the_pass_and_its_update(two_rank_update):
    """algo.old_logp_from_update on 2 ranks, one running more micro-batches: each rank's update forward gives its
    rows' old log-probs and entropy, and every rank ends with all of them, those of one process's pass."""
    single, runs, _, _ = two_rank_update
    two = runs["from_update_uneven"]
    grad_diff = max((two["delta"][k] - single["delta"][k]).abs().max().item() for k in single["delta"])
    assert two["counts"][0] > two["counts"][1] and grad_diff < 1e-6
    assert two["stats"]["pg_loss"] == pytest.approx(single["stats"]["pg_loss"], abs=1e-6)
    assert (two["old_logp"] - single["old_logp"]).abs().max().item() < 1e-5 and single["old_logp"].abs().max() > 0.1
    assert (two["entropy"] - single["entropy"]).abs().max().item() < 1e-5


def test_ranks_with_fewer_micro_batches_join_with_empty_passes(two_rank_update):
    single, runs, _, _ = two_rank_update
    uneven = runs["uneven"]
    assert uneven["counts"][0] > uneven["counts"][1]  # rank 1 ran empty passes to match rank 0
    grad_diff = max((uneven["delta"][k] - single["delta"][k]).abs().max().item() for k in single["delta"])
    print(f"\nmicro-batches per rank {uneven['counts']}: max |d grad| vs 1 rank {grad_diff:.2e}")
    assert grad_diff < 1e-6
    assert uneven["stats"]["pg_loss"] == pytest.approx(single["stats"]["pg_loss"], abs=1e-6)
    assert (uneven["old_logp"] - single["old_logp"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("variant", ["shared", "shared_uneven"])
def test_two_ranks_sharing_prompts_give_the_loss_and_gradients_of_one_unshared(two_rank_update, variant):
    """Each rank runs its prompts once and its responses against them (two decoder calls inside the
    sharded forward): the same log-probs, loss and gradients as one process recomputing every prompt;
    also when one rank runs more micro-batches and the other joins with empty passes."""
    single, runs, _, _ = two_rank_update
    two = runs[variant]
    grad_diff = max((two["delta"][k] - single["delta"][k]).abs().max().item() for k in single["delta"])
    print(f"\n{variant}, 2 ranks vs 1 unshared: max |d grad| {grad_diff:.2e}, micro-batches per rank {two['counts']}")
    assert grad_diff < 1e-6
    assert two["stats"]["pg_loss"] == pytest.approx(single["stats"]["pg_loss"], abs=1e-6)
    assert two["stats"]["grad_norm"] == pytest.approx(single["stats"]["grad_norm"], rel=1e-5)
    assert (two["old_logp"] - single["old_logp"]).abs().max().item() < 1e-5
    assert (two["entropy"] - single["entropy"]).abs().max().item() < 1e-5
    if variant == "shared_uneven":
        assert two["counts"][0] > two["counts"][1]


def test_every_ranks_rollout_engine_gets_the_trainers_weights(two_rank_update):
    _, runs, _, _ = two_rank_update
    two = runs["fp32"]
    assert two["engine_sums"] == [two["trainer_sums"]] * 2  # rank 0's copy and rank 1's
    assert any(v.abs().max() > 0 for v in two["delta"].values())  # and they are the updated ones


def test_ranks_sample_shares_of_the_prompts_and_all_get_every_sample(two_rank_update):
    _, runs, _, _ = two_rank_update
    two = runs["fp32"]
    (prompt_ids, response_ids, truncated), other = two["gens"]
    assert other == (prompt_ids, response_ids, truncated)  # the same Generation on both ranks
    assert prompt_ids == [p for p in two["prompts"] for _ in range(2)]  # prompt-major, in order
    assert len(response_ids) == 6 and all(0 < len(r) <= 6 for r in response_ids)


def test_sharded_checkpoint_exports_to_a_model_directory(two_rank_update, tmp_path):
    from transformers import AutoModelForCausalLM

    _, runs, tmp, _ = two_rank_update
    two = runs["fp32"]
    ckpt = checkpoint.latest_checkpoint(tmp / "fp32")
    assert ckpt is not None and checkpoint_weights.is_sharded(ckpt) and not (ckpt / "model").exists()
    assert sorted(p.name for p in (ckpt / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with pytest.raises(RuntimeError, match="dapo export"):
        checkpoint_weights.load_model_weights(None, ckpt)
    assert cli.main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    exported = dict(model.named_parameters())
    for k, v in two["after"].items():
        assert torch.equal(exported[k].float(), v), k
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()


# ---- resuming under torchrun ---------------------------------------------------------------------
def test_ranks_resuming_refuse_a_crafted_checkpoint_index(two_rank_update):
    """Resume is automatic: a step directory whose shards/.metadata pickles os.system stops both ranks with the
    reason, before anything in it runs (the CLI prints it as its one error line: tests/test_checkpoint.py)."""
    _, _, tmp, _ = two_rank_update
    refusals = [(tmp / f"crafted.{rank}.txt").read_text() for rank in range(2)]
    assert not (tmp / "pwned").exists()
    assert all("names posix.system, which is not checkpoint metadata" in line for line in refusals), refusals
    assert all("\n" not in line for line in refusals)


# ---- LoRA: 2 ranks vs 1 --------------------------------------------------------------------------
def lora_update(d, model_dir: str, batch_file: Path, out_dir: Path) -> None:
    """Under torchrun, with LoRA adapters: log-probs, one SGD update (lr 1: the change is minus the gradient), the
    reference with the adapters off, the merged push into every rank's engine, a sharded checkpoint and its reload."""
    from conftest import training_engine
    from test_lora import LORA, ONE_UPDATE

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
    step = save_step_1(policy, out_dir / "run", d)
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


def lora_reference(model_dir, tmp: Path) -> None:
    """The single process's LoRA update, before the launch: its batch (lora_batch.pt, which the ranks train on) and
    its log-probs, losses, update and merged weights (lora_single.pt)."""
    from test_lora import LORA, ONE_UPDATE, sampled

    cfg = small_config(tmp / "lora_single", model_dir, *LORA, *ONE_UPDATE, "train.micro_batch_size=2")
    torch.manual_seed(0)
    policy = make_policy(cfg)
    policy.optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=1.0)
    batch = sampled(policy)
    torch.save(batch, tmp / "lora_batch.pt")
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    stats = {k: float(v) for k, v in policy.update(batch, loss_fn_of(cfg)).items()}
    single = {
        "old_logp": batch.old_logp,
        "stats": stats,
        "merged": dict(policy.named_weights()),
        "delta": {k: v.detach() - before[k] for k, v in policy.model.named_parameters()},
    }
    torch.save(single, tmp / "lora_single.pt")


@pytest.fixture(scope="module")
def two_rank_lora(two_rank_update):
    """The LoRA update of one process and of the two ranks (in the equivalence launch), and the ranks' folder."""
    tmp = two_rank_update[2]
    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    return load(tmp / "lora_single.pt"), load(tmp / "lora" / "two.pt"), tmp / "lora"


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


# ---- GPUs (skipped without two CUDA devices; CI has none) -----------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nccl)")
def test_two_gpus_nccl_bf16_cpu_offload_checkpointing(tiny_model_dir, tmp_path):
    torchrun(
        "-m",
        "dapo.cli",
        "train",
        "configs/demo.yaml",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path}",
        *SMALL_OVERRIDES,
        "model.device=cuda",
        "model.dtype=bfloat16",
        "model.gradient_checkpointing=true",
        "train.cpu_offload=true",
    )
    ckpt = checkpoint.latest_checkpoint(tmp_path / "t")
    assert ckpt is not None and checkpoint_weights.is_sharded(ckpt)
    rows = [line for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all('"actor/grad_norm": NaN' not in r for r in rows)


if __name__ == "__main__":  # the torchrun worker
    mode, *rest = sys.argv[1:]
    {"equivalence": equivalence_worker}[mode](*rest)


def test_cpu_offload_in_one_process_is_refused_and_gpus_get_gloo_beside_nccl():
    # one process is not sharded, so FSDP would never see the offload policy: the run would hold everything
    # on the GPU while the config says otherwise
    from dapo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train.cpu_offload=true: FSDP does the offloading") as err:
        parallel.wrap(torch.nn.Linear(2, 2), [], parallel.Dist(), compute_dtype=torch.float32, cpu_offload=True)
    assert "\n" not in str(err.value)
    assert parallel.wrap(lin := torch.nn.Linear(2, 2), [], parallel.Dist(), compute_dtype=torch.float32) is lin
    # offloaded shards are gathered on CPU (weight push, export): nccl alone cannot run those collectives
    assert parallel.backend_for(True) == "cpu:gloo,cuda:nccl" and parallel.backend_for(False) == "gloo"
