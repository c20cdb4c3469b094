"""LoRA adapters (model.lora) with peft on tiny models: only the adapters train and are saved, the
rollout engines sample from the merged model, resume is exact, export reproduces the trainer's
logits. FSDP on 2 ranks with LoRA: tests/test_parallel.py; vLLM with LoRA: tests/test_lora_scale.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES, loss_fn_of, make_policy, small_config, train_in_one_thread  # noqa: E402
from dapo import checkpoint, cli  # noqa: E402
from dapo.config import ConfigError, load_config  # noqa: E402
from dapo.model.loading import load_model_and_tokenizer  # noqa: E402
from dapo.reporting.run_log import read_metrics  # noqa: E402
from dapo.rollout import SamplingParams  # noqa: E402
from dapo.rollout.hf import HFRolloutEngine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LORA = ("model.lora.rank=4",)
ONE_UPDATE = ("train.prompts_per_step=3", "train.mini_batch_prompts=3", "train.grad_clip=1e9")


def adapter_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def base_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def sampled(policy, **kw):
    from conftest import sampled_batch

    return sampled_batch(policy, **kw)


def trained_policy(cfg, updates: int = 1, lr: float | None = None):
    """A LoRA policy after ``updates`` steps on a sampled batch (adapters no longer zero)."""
    torch.manual_seed(0)
    policy = make_policy(cfg)
    if lr is not None:
        for group in policy.optimizer.param_groups:
            group["lr"] = lr
    batch = sampled(policy)
    for _ in range(updates):
        policy.update(batch, loss_fn_of(cfg))
    return policy, batch


# ---- settings ------------------------------------------------------------------------------------
def test_lora_is_off_by_default_and_set_from_yaml_or_dotted_overrides(tmp_path):
    cfg = load_config("configs/demo.yaml")
    assert cfg.model.lora.rank is None and not cfg.model.lora.enabled
    cfg = load_config(
        "configs/demo.yaml",
        ["model.lora.rank=16", "model.lora.target_modules=[q_proj,v_proj]", "model.lora.dropout=0.05"],
    )
    assert (cfg.model.lora.rank, cfg.model.lora.lora_alpha, cfg.model.lora.dropout) == (16, 32.0, 0.05)
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  lora:\n    rank: 8\n    alpha: 8\n")
    got = load_config(preset).model.lora
    assert (got.rank, got.lora_alpha, got.target_modules[-1]) == (8, 8.0, "down_proj")
    shipped = load_config("configs/smollm2_135m_lora.yaml")
    assert shipped.model.lora.rank == 16
    assert shipped.train.lr == pytest.approx(10 * load_config("configs/smollm2_135m.yaml").train.lr)


@pytest.mark.parametrize(
    "override, start",
    [
        ("model.lora.rank=0", "model.lora.rank=0: must be > 0, or null (off"),
        ("model.lora.rank=2.5", "model.lora.rank: expected an integer"),
        ("model.lora.alpha=-1", "model.lora.alpha=-1.0: must be > 0, or null (2 x rank)"),
        ("model.lora.dropout=1", "model.lora.dropout=1.0: must be in [0, 1)"),
        ("model.lora.target_modules=[]", "model.lora.target_modules=[]: name at least one linear layer"),
        ("model.lora.ranks=4", "model.lora.ranks: unknown key"),
    ],
)
def test_bad_lora_settings_are_one_line_naming_the_key(override, start):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", override.split())
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_a_target_that_matches_no_linear_layer_lists_the_models_layers(tiny_model_dir, tmp_path, capsys):
    cfg = small_config(tmp_path, tiny_model_dir, *LORA, "model.lora.target_modules=[q_proj,qkv,lm_head]")
    with pytest.raises(ConfigError) as err:
        make_policy(cfg)
    assert str(err.value).startswith("model.lora.target_modules: qkv, lm_head match no linear layer of ")
    assert "(the LM head excluded) are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in str(err.value)
    capsys.readouterr()
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'r'}",
            *SMALL_OVERRIDES,
            *LORA,
            "model.lora.target_modules=[attn]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: model.lora.target_modules: attn match no")
    assert not (tmp_path / "r").exists()


# ---- the update ----------------------------------------------------------------------------------
def test_an_update_changes_only_the_adapters(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, *LORA)  # 2 optimizer updates per step: lora_A moves too
    torch.manual_seed(0)
    policy = make_policy(cfg)
    base, _ = load_model_and_tokenizer(tiny_model_dir)
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    # 2 layers x 7 linear modules x (A, B); nothing else trains or reaches the optimizer
    assert len(trained) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in policy.optimizer.param_groups) == 28
    batch = sampled(policy)
    # the adapters start at B = 0: the policy is the base model, to the bit
    assert torch.equal(logits(policy.model, batch.prompt_ids[0]), logits(base, batch.prompt_ids[0]))
    before_base, before_adapters = base_params(policy.model), adapter_params(policy.model)
    policy.update(batch, loss_fn_of(cfg))
    after_base, after_adapters = base_params(policy.model), adapter_params(policy.model)
    assert before_base.keys() == after_base.keys() and len(after_base) == len(list(base.parameters()))
    assert [n for n in before_base if not torch.equal(before_base[n], after_base[n])] == []  # every base weight
    moved = [n for n in before_adapters if not torch.equal(before_adapters[n], after_adapters[n])]
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert len(policy.optimizer.state) == 28  # AdamW moments for the adapters alone


def test_gradient_checkpointing_and_bf16_train_the_adapters_as_float32(tiny_model_dir, tmp_path):
    """Recomputed layers still reach the adapters; under a bf16 base peft keeps the adapters in float32, so
    they need no master copy and take the float32 step up to bf16 noise in the gradient."""
    batch, deltas = None, {}
    for name, extra in {
        "fp32": [],
        "checkpointed": ["model.gradient_checkpointing=true"],
        "bf16": ["model.dtype=bfloat16"],
    }.items():
        cfg = small_config(tmp_path, tiny_model_dir, *LORA, *ONE_UPDATE, *extra)
        torch.manual_seed(0)  # the same adapter initialisation
        policy = make_policy(cfg)
        batch = batch or sampled(policy)  # the same samples for all three
        batch.old_logp, _ = policy.compute_logprobs(batch)  # each under its own compute dtype: ratio 1
        before = adapter_params(policy.model)
        policy.update(batch, loss_fn_of(cfg))
        deltas[name] = torch.cat([(p - before[n]).flatten() for n, p in adapter_params(policy.model).items()])
        if name == "bf16":
            assert policy.master is None
            assert {p.dtype for n, p in policy.model.named_parameters() if ".lora_" in n} == {torch.float32}
            assert {p.dtype for n, p in policy.model.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
    assert deltas["fp32"].abs().max() > 1e-4
    assert torch.allclose(deltas["checkpointed"], deltas["fp32"], atol=1e-8)
    d32, d16 = deltas["fp32"], deltas["bf16"]
    assert d16.abs().mean().item() == pytest.approx(d32.abs().mean().item(), rel=0.02)
    assert (torch.sign(d16) == torch.sign(d32)).float().mean() > 0.95


def test_shared_prompts_give_the_unshared_lora_update(tiny_model_dir, tmp_path):
    """train.share_prompt_prefix (on in the SmolLM2 presets, so in the LoRA one) runs the decoder through its
    KV-cache interface: the adapted layers take part in it like any other, gradients included, and the
    reference with the adapters off shares prompts too."""
    batch, out = None, {}
    for share in ("false", "true"):
        cfg = small_config(
            tmp_path,
            tiny_model_dir,
            *LORA,
            *ONE_UPDATE,
            f"train.share_prompt_prefix={share}",
            "model.gradient_checkpointing=true",
        )
        torch.manual_seed(0)
        policy = make_policy(cfg)
        # SGD at lr 1: the change is minus the gradient (AdamW's first step, g / |g|, magnifies float noise)
        policy.optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=1.0)
        batch = batch or sampled(policy)
        batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
        before = adapter_params(policy.model)
        policy.update(batch, loss_fn_of(cfg))
        delta = torch.cat([(p - before[n]).flatten() for n, p in adapter_params(policy.model).items()])
        out[share] = (
            batch.old_logp.clone(),
            delta,
            policy.compute_logprobs(batch)[0],
            policy.base_reference().logprobs(batch),
        )
    (logp0, d0, after0, ref0), (logp1, d1, after1, ref1) = out["false"], out["true"]
    assert d0.abs().max() > 1e-3
    assert (logp1 - logp0).abs().max() < 1e-5 and (d1 - d0).abs().max() < 1e-6
    assert (after1 - after0).abs().max() < 1e-5 and (ref1 - ref0).abs().max() < 1e-5
    assert (after0 - ref0).abs().max() > 1e-3  # the update moved the adapters' log-probs away from the base


# ---- the rollout engines and the reference -------------------------------------------------------
def test_merged_weights_are_peft_merge_under_the_base_names(tiny_model_dir, tmp_path):
    import copy

    policy, _ = trained_policy(small_config(tmp_path, tiny_model_dir, *LORA))
    merged = dict(policy.named_weights())
    reference = copy.deepcopy(policy.model).merge_and_unload()  # peft's in-place merge, on a copy
    base, _ = load_model_and_tokenizer(tiny_model_dir)
    assert list(merged) == [n for n, _ in base.named_parameters()]  # the base model's own names, in its order
    assert all(torch.equal(merged[n], p) for n, p in reference.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], dict(base.named_parameters())[q])  # the adapters are in it
    assert torch.equal(merged["model.norm.weight"], dict(base.named_parameters())["model.norm.weight"])
    assert not any(m.merged for m in policy.model.modules() if hasattr(m, "merged_adapters"))


def test_the_hf_engine_samples_with_the_live_adapters(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, *LORA)
    policy, _ = trained_policy(cfg, updates=3, lr=0.05)
    engine = HFRolloutEngine(policy.model, policy.tokenizer)  # as a one-process run builds it: the trainer's model
    engine.update_weights(iter(()))  # nothing to load: it is the trainer's own peft model
    merged, _ = load_model_and_tokenizer(tiny_model_dir)
    merged.load_state_dict(dict(policy.named_weights()), strict=False)  # (lm_head is tied to the embeddings)
    base, _ = load_model_and_tokenizer(tiny_model_dir)
    prompts = [policy.tokenizer(p)["input_ids"] for p in ("1+2=", "3*4-5=", "6+7*2=")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    ours = engine.generate(prompts, greedy).response_ids
    assert ours == HFRolloutEngine(merged, policy.tokenizer).generate(prompts, greedy).response_ids
    assert ours != HFRolloutEngine(base, policy.tokenizer).generate(prompts, greedy).response_ids


def test_the_reference_is_the_base_with_the_adapters_off(tiny_model_dir, tmp_path):
    from dapo.model.policy import BaseReference, ReferenceModel

    cfg = small_config(tmp_path, tiny_model_dir, *LORA, "rollout.temperature=0.8")
    policy, batch = trained_policy(cfg, updates=2, lr=0.05)
    reference = policy.base_reference()
    assert isinstance(reference, BaseReference)
    copy_of_base = ReferenceModel(cfg.model, cfg.train, temperature=0.8, device=torch.device("cpu"))
    ref_logp = reference.logprobs(batch)  # (N, T)
    assert torch.equal(ref_logp, copy_of_base.logprobs(batch))
    assert (policy.compute_logprobs(batch)[0] - ref_logp).abs().max() > 1e-3  # and the adapters are back on


# ---- checkpoints ---------------------------------------------------------------------------------
RESUME_OVERRIDES = [
    *LORA,
    "train.total_steps=3",
    "run.save_every=1",
    "algo.kl_coef=0.01",
    "train.lr=1e-2",
    "algo.dynamic_sampling=true",
    "algo.filter_metric=reward",
    "algo.max_gen_rounds=3",
    "algo.oversample=3.0",
    "algo.held_over_max_groups=8",
    "run.async_checkpoint=true",
]


def run_driver(run_dir, model_dir, saves, tag, kill_after):
    """tests/train_until_checkpoint.py in a process of its own, with the LoRA run's settings."""
    import os

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "500",
    }
    cmd = [
        sys.executable,
        str(REPO / "tests" / "train_until_checkpoint.py"),
        str(run_dir),
        str(model_dir),
        str(saves),
        tag,
        str(kill_after),
        *RESUME_OVERRIDES,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def train_here(run_dir, model_dir) -> None:
    """The LoRA run as the driver trains it (its settings, one torch thread, as its process has), in this process."""
    train_in_one_thread(small_config(run_dir, model_dir, *RESUME_OVERRIDES))


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir, tmp_path_factory):
    """A LoRA run of 3 steps never interrupted, here, and one killed (os._exit) after checkpoint 1 in a process of its
    own (which the test resumes)."""
    root = tmp_path_factory.mktemp("lora-runs")
    train_here(root / "a", tiny_model_dir)
    killed = run_driver(root / "b", tiny_model_dir, root / "saves_b.txt", "killed", 1)
    assert killed.returncode == 1, killed.stderr[-3000:]  # the hard exit
    return root / "a" / "t", root / "b"


def test_a_lora_checkpoint_holds_the_adapters_not_the_base(lora_runs, tiny_model_dir, capsys):
    from safetensors.torch import load_file

    full, _ = lora_runs
    step = full / "checkpoints" / "step_000003"
    assert not (step / "model").exists()
    files = {p.name for p in (step / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(tiny_model_dir))
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    weights = load_file(step / "adapter" / "adapter_model.safetensors")
    assert len(weights) == 28 and all(".lora_A." in k or ".lora_B." in k for k in weights)
    base_numel = sum(t.numel() for t in load_file(Path(tiny_model_dir) / "model.safetensors").values())
    assert sum(t.numel() for t in weights.values()) < base_numel / 5
    state = checkpoint.load_trainer_state(step)
    assert len(state["policy"]["optimizer"]["state"]) == 28 and "master_weights" not in state["policy"]
    assert any(bool(w.abs().sum()) for k, w in weights.items() if ".lora_B." in k)  # trained, not the zero init
    assert cli.main(["eval", "--run", str(full)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {step} holds LoRA adapters; run `dapo export {step} OUT_DIR` and evaluate --model OUT_DIR\n"


def test_a_killed_lora_run_resumes_to_the_adapters_of_an_uninterrupted_one(lora_runs, tiny_model_dir, capsys):
    from safetensors.torch import load_file

    full, killed = lora_runs
    capsys.readouterr()
    train_here(killed, tiny_model_dir)  # the resume, in this process
    said = capsys.readouterr().out
    resumed_dir = killed / "t"
    assert "resumed from" in said and "step_000001 (step 1)" in said
    assert (
        "LoRA rank 4 (alpha 8) on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj: 5,888 trained "
        "parameters, " in " ".join(said.split())
    )
    a = {r["step"]: r for r in read_metrics(full)}
    b = {r["step"]: r for r in read_metrics(resumed_dir)}
    assert a[2]["sampling/groups_from_held_over"] > 0 and "actor/kl_loss" in a[3]  # buffer and reference resumed too
    for step in (2, 3):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "reward/score_mean"):
            assert b[step][key] == a[step][key], (step, key)
    want = load_file(full / "checkpoints" / "step_000003" / "adapter" / "adapter_model.safetensors")
    got = load_file(resumed_dir / "checkpoints" / "step_000003" / "adapter" / "adapter_model.safetensors")
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []


@pytest.mark.parametrize(
    "saved, resumed, says",
    [
        (LORA, [], "holds LoRA adapters (adapter/) and this run has model.lora.rank=null: set model.lora as"),
        ([], LORA, "holds full weights (no adapter/) and this run has model.lora.rank=4: drop model.lora.rank"),
        (LORA, ["model.lora.rank=8"], "holds a LoRA adapter with model.lora.rank=4, this run asks for 8"),
        (
            LORA,
            [*LORA, "model.lora.target_modules=[q_proj]"],
            "with model.lora.target_modules=['down_proj', 'gate_proj',",
        ),
    ],
)
def test_a_checkpoint_resumes_only_a_run_of_its_kind(saved, resumed, says, tiny_model_dir, tmp_path, capsys):
    base = [
        "train",
        "configs/demo.yaml",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path}",
        *SMALL_OVERRIDES,
        "train.total_steps=1",
    ]
    assert cli.main([*base, *saved]) == 0
    capsys.readouterr()
    code = cli.main([*base, "train.total_steps=2", *resumed])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert says in err
    assert [r["step"] for r in read_metrics(tmp_path / "t")] == [1]  # nothing trained on the wrong weights


# ---- export --------------------------------------------------------------------------------------
def test_export_writes_the_merged_model_or_the_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = small_config(tmp_path, tiny_model_dir, *LORA)
    policy, _ = trained_policy(cfg, updates=2, lr=0.05)
    step = checkpoint.save_checkpoint(
        tmp_path / "run", 2, model=policy.model, tokenizer=policy.tokenizer, trainer_state={}, config_yaml="", keep=1
    )
    ids = policy.tokenizer("12+7*3=")["input_ids"]
    want = logits(policy.model, ids)
    assert (want - logits(load_model_and_tokenizer(tiny_model_dir)[0], ids)).abs().max() > 1e-2  # not the base's

    assert cli.main(["export", str(step), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert (logits(merged, ids) - want).abs().max() < 1e-5
    assert (tmp_path / "merged" / "tokenizer_config.json").exists()

    assert cli.main(["export", str(step), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    assert torch.equal(logits(reloaded, ids), want)


def test_export_of_a_moved_base_or_a_full_checkpoint_as_adapter_is_one_line(tiny_model_dir, tmp_path, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    cfg = small_config(tmp_path, base, *LORA)
    policy = make_policy(cfg)
    step = checkpoint.save_checkpoint(
        tmp_path / "run", 1, model=policy.model, tokenizer=policy.tokenizer, trainer_state={}, config_yaml="", keep=1
    )
    moved = tmp_path / "moved-base"
    shutil.move(base, moved)  # the adapters name a base that is no longer where it was trained
    capsys.readouterr()  # only the export's own output below (not the model's loading bar)
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a model directory here; give the base with --base DIR" in err
    assert cli.main(["export", str(step), str(tmp_path / "out"), "--base", str(moved)]) == 0
    full = checkpoint.save_checkpoint(
        tmp_path / "full",
        1,
        model=load_model_and_tokenizer(tiny_model_dir)[0],
        tokenizer=policy.tokenizer,
        trainer_state={},
        config_yaml="",
        keep=1,
    )
    assert cli.main(["export", str(full), str(tmp_path / "x"), "--adapter"]) == 2
    assert "holds full weights, not LoRA adapters: drop --adapter" in capsys.readouterr().err
