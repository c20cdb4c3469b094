"""The other CUDA paths against their CPU and float32 twins (the items b-g, m and n of `make gpu-check`; a, i and t,
the update itself, are tests/test_gpu.py's, whose docstring says how the devices and the CPU twins run).

  b  the shared prompt prefix against the unshared pass: eager and SDPA (flash, memory-efficient, math)
  c  HeadLogProbs against full logits, float32 and bf16, across chunk boundaries
  d  the trainer's fused AdamW against torch's reference (foreach) AdamW
  e  LoRA: only the adapters change; the merged export reproduces the trainer's logits
  f  a run stopped hard after checkpoint k resumes to the final weights of an uninterrupted run
  g  perf/peak_cuda_<phase>_gb against torch.cuda.max_memory_allocated
  m  the rollout process of rollout.max_staleness on the device: the in-process engine's tokens and log-probs
  n  a rollout rank under torchrun on the device against the rollout process
  u  the HF engine's decode loop on the device (a prompt's prefill shared by its rows, ended rows leaving the batch)
     against transformers' generate: the same tokens for the seed
  v  algo.old_logp_from_update: the first update's old log-probs from its own forward against a pass over every row
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import loss_fn_of, make_policy, small_config  # noqa: E402
from dapo import checkpoint, cli  # noqa: E402
from dapo.reporting.run_log import read_metrics  # noqa: E402
from test_gpu import BF16_EPS, DEVICES, HEAVY_DEVICES, REPO, env_for_children, report  # noqa: E402


# ---- b: the shared prompt prefix ---------------------------------------------------------------
def sdpa_backends(name: str):
    """The SDPA kernels a variant allows (torch.nn.attention.sdpa_kernel); None: the model's eager attention."""
    from torch.nn.attention import SDPBackend

    # math stays allowed behind the kernel tried, for the calls that kernel cannot take (torch picks flash, then
    # memory-efficient, then math): without a mask transformers asks SDPA for grouped-query attention, which the
    # memory-efficient kernel does not do; flash takes no attention mask, so passes without padding (and the
    # prompt pass) run it, while response passes over a cached prompt need a mask and fall to memory-efficient.
    # The test checks that the kernel named did run.
    return {
        "eager": None,
        "math": [SDPBackend.MATH],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }[name]


# which attention kernels run on each device: CPU has SDPA's math and its own flash kernel, not the CUDA ones
# (float32 eager and sdpa on the CPU: tests/test_prefix.py; the batch without padding matters for flash only)
PREFIX_VARIANTS = {
    "cpu": [("eager", "bfloat16")],
    "cuda": [
        ("eager", "float32"),
        ("math", "float32"),
        ("efficient", "float32"),
        ("eager", "bfloat16"),
        ("efficient", "bfloat16"),
        ("flash", "bfloat16"),
    ],
}


def logp_and_grads(lm, batch, rows, device, *, share: bool, backends, equal_lengths: bool = False):
    """log-probs (B, T) and the gradient of sum(logp x advantage), in float32 on the CPU, and the SDPA kernels run."""
    import contextlib

    from torch.nn.attention import sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from dapo.model.logprobs import token_logprobs
    from dapo.model.micro_batch import make_micro_batch

    lm.zero_grad(set_to_none=True)
    mb = make_micro_batch(batch, rows, 0, device, share_prompts=share)
    within = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    watch = profile(activities=[ProfilerActivity.CPU]) if backends else contextlib.nullcontext()
    with within, watch as prof:
        logp, _ = token_logprobs(lm, mb, temperature=0.9, chunk_tokens=64)
        (logp * batch.adv[rows].to(device)[:, None]).sum().backward()
    kernels = (
        sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name and "backward" not in e.name})
        if backends
        else []
    )
    grads = {n: p.grad.float().cpu() for n, p in lm.named_parameters()}
    return logp.detach().float().cpu(), grads, kernels


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prompt_prefix_gives_the_unshared_log_probs_and_gradients(device):
    """Prompts of 57-143 tokens with padding, and a batch of equal lengths (no padding, where flash runs).
    float32: shared and unshared within 1e-5 (log-probs) and 1e-5 of the largest gradient entry (as on the
    CPU in tests/test_prefix.py, here with each kernel). bf16: the two paths round in different places, so
    they differ by bf16 noise (with flash allowed, the unshared pass runs flash and the response passes the
    memory-efficient kernel). With t the float32 pass, u and s the unshared and shared bf16 ones: sharing may
    not err more than twice what bf16 costs the unshared pass, so |s - u| <= |s - t| + |u - t| <= 3 |u - t|
    (plus 1e-6)."""
    from test_prefix import ROWS, synthetic_batch, tiny_lm

    # on the CPU fewer rows (3 of the prompts, one row out of order): CI time
    batches = [("padded", synthetic_batch(), ROWS if device == "cuda" else [0, 1, 2, 3, 13, 8, 9, 10])]
    if device == "cuda":
        batches.append(
            ("equal", synthetic_batch((64, 64), ((16, 16, 16, 16), (16, 16, 16, 16)), seed=1), list(range(8)))
        )
    figures = {}
    for attention, dtype in PREFIX_VARIANTS[device]:
        lm = tiny_lm("qwen2", "eager" if attention == "eager" else "sdpa").to(device).train()
        truth = {}
        for name, batch, rows in batches:
            if dtype == "bfloat16":  # the float32 pass with the same kernels: what bf16 alone costs
                truth[name] = logp_and_grads(lm, batch, rows, device, share=False, backends=sdpa_backends(attention))
        lm = lm.to(torch.bfloat16) if dtype == "bfloat16" else lm
        for name, batch, rows in batches:
            backends = sdpa_backends(attention)
            logp, grads, k_unshared = logp_and_grads(lm, batch, rows, device, share=False, backends=backends)
            logp_s, grads_s, k_shared = logp_and_grads(lm, batch, rows, device, share=True, backends=backends)
            scale = max(g.abs().max().item() for g in grads.values())
            d_logp = (logp_s - logp).abs().max().item()
            d_grad = max((grads_s[n] - g).abs().max().item() for n, g in grads.items())
            key = f"{attention} {dtype} {name}"
            figures[key] = {
                "logp_diff": d_logp,
                "grad_diff": d_grad,
                "grad_scale": scale,
                "kernels": sorted(set(k_unshared) | set(k_shared)),
            }
            assert scale > 1e-3 and (logp[logp != 0] < 0).all()
            if dtype == "float32":
                bound_logp, bound_grad = 1e-5, 1e-5 * scale
            else:
                t_logp, t_grads, _ = truth[name]
                bound_logp = 3 * (logp - t_logp).abs().max().item() + 1e-6
                bound_grad = 3 * max((grads[n] - g).abs().max().item() for n, g in t_grads.items()) + 1e-6
                assert (logp - t_logp).abs().max().item() < 0.05  # bf16 itself: a logit of ~5 rounded, twice
            figures[key] |= {"bound_logp": bound_logp, "bound_grad": bound_grad}
            assert d_logp <= bound_logp, (key, figures[key])
            assert d_grad <= bound_grad, (key, figures[key])
            if attention == "flash" and name == "equal":  # no padding: the flash kernel itself ran
                assert any("flash" in k for k in k_unshared), k_unshared
            if attention == "efficient":
                assert any("efficient" in k for k in k_unshared + k_shared), k_unshared + k_shared
    report(f"b prefix {device}", **figures)


def test_a_batch_without_padding_reaches_sdpa_without_a_mask_so_flash_can_take_it(monkeypatch):
    """Item b's flash case rests on transformers dropping an all-ones mask: flash takes no attention mask, so
    the unshared pass over equal lengths and the shared prompt pass must reach SDPA with none (is_causal
    instead). Checked here on the CPU, where the same call is made; padding and the response passes over a
    cached prompt must keep theirs."""
    import torch.nn.functional as F

    from dapo.model.logprobs import token_logprobs
    from dapo.model.micro_batch import make_micro_batch
    from test_prefix import synthetic_batch, tiny_lm

    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal, q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lm = tiny_lm("qwen2", "sdpa")
    seen = {}
    for name, batch in (
        ("equal", synthetic_batch((64, 64), ((16, 16, 16, 16), (16, 16, 16, 16)), seed=1)),
        ("padded", synthetic_batch()),
    ):
        for share in (False, True):
            calls.clear()
            with torch.no_grad():
                token_logprobs(
                    lm,
                    make_micro_batch(batch, list(range(8)), 0, "cpu", share_prompts=share),
                    temperature=0.9,
                    chunk_tokens=64,
                )
            seen[name, share] = list(calls)
    # 2 layers each: one pass of 64 + 16 tokens; shared: the 64-token prompts, then 15 response tokens over 79 keys
    assert seen["equal", False] == [(True, True, 80, 80)] * 2
    assert seen["equal", True] == [(True, True, 64, 64)] * 2 + [(False, False, 15, 79)] * 2
    assert all(not no_mask for no_mask, *_ in seen["padded", False] + seen["padded", True])


# ---- c: HeadLogProbs ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_log_probs_against_full_logits_across_chunks(device, dtype):
    """The trainer's chunk on CUDA (CUDA_HEAD_CHUNK_ROWS, 1024 rows) over 2 full chunks and a partial one;
    on the CPU the same rows with a chunk forced to 300 (the CPU's own would hold them all in one).
    The reference: the full (n, V) logits through autograd, from the same dtype's inputs. float32: 2e-5
    (log-sum-exp over 3,000 logits summed in another order). bf16: both sides round h @ W^T to bf16, but a
    matmul over a chunk's rows may take another kernel than one over all rows (cuBLAS picks by shape), so a
    logit may round the other way: one rounding (BF16_EPS of the largest logit) in the target's logit and one
    in the log-sum-exp. Gradients within 2% of their largest entry (bf16 products of float32 coefficients)."""
    from dapo.model.logprobs import CUDA_HEAD_CHUNK_ROWS, HeadLogProbs, head_chunk_rows
    from test_logprobs import _head_reference

    V, H, T = 3000, 64, 0.8
    chunk = head_chunk_rows(V, torch.device(device)) if device == "cuda" else 300
    n = 2 * (CUDA_HEAD_CHUNK_ROWS if device == "cuda" else chunk) + 37
    assert device == "cpu" or chunk == CUDA_HEAD_CHUNK_ROWS
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(n, H, generator=gen)
    w0 = torch.randn(V, H, generator=gen) * 0.25  # logits ~ N(0, 4)
    targets = torch.randint(0, V, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    dt = getattr(torch, dtype)
    out = []
    for fused in (True, False):
        h = h0.to(device, dt).requires_grad_()
        w = w0.to(device, dt).requires_grad_()
        y = targets.to(device)
        if fused:
            logp, entropy = HeadLogProbs.apply(h, w, y, T, chunk, True)
        else:
            logp, entropy = _head_reference(h, w, y, T)
        (upstream.to(device) * logp).sum().backward()
        out.append([t.detach().float().cpu() for t in (logp, entropy, h.grad, w.grad)])
    (lp, ent, gh, gw), (lp_r, ent_r, gh_r, gw_r) = out
    tol = 2e-5 if dtype == "float32" else 2 * BF16_EPS * ((h0 @ w0.t()).abs().max().item() / T)
    grad_tol = 1e-5 if dtype == "float32" else 0.02
    found = {
        "logp_diff": (lp - lp_r).abs().max().item(),
        "entropy_diff": (ent - ent_r).abs().max().item(),
        "grad_h_rel": ((gh - gh_r).abs().max() / gh_r.abs().max()).item(),
        "grad_w_rel": ((gw - gw_r).abs().max() / gw_r.abs().max()).item(),
        "chunk": chunk,
        "rows": n,
        "logp_bound": tol,
    }
    report(f"c head {device} {dtype}", **found)
    assert found["logp_diff"] <= tol and found["entropy_diff"] <= tol, found
    assert found["grad_h_rel"] <= grad_tol and found["grad_w_rel"] <= grad_tol, found
    assert gw_r.abs().max() > 1e-2  # a gradient that means something


# ---- d: fused AdamW ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_adamw_takes_the_reference_adamw_steps(tiny_model_dir, tmp_path, device, dtype):
    """The trainer's optimizer is torch's fused AdamW on the device (on the float32 masters under bf16);
    three steps leave weights and moments where the foreach AdamW leaves them. Tolerance: float32
    rounding of a few elementwise operations per step in another order (rtol 1e-6, atol 1e-7: the
    weights are ~0.02, the steps 1e-3)."""
    cfg = small_config(tmp_path, tiny_model_dir, "train.lr=1e-3", "train.weight_decay=0.1", f"model.dtype={dtype}")
    policy = make_policy(cfg, device)
    assert policy.optimizer.param_groups[0]["fused"]
    params = policy.master or [p for p in policy.model.parameters() if p.requires_grad]
    assert {p.device.type for p in params} == {device} and {p.dtype for p in params} == {torch.float32}
    start = [p.detach().clone() for p in params]
    twins = [torch.nn.Parameter(p.clone()) for p in start]
    reference = torch.optim.AdamW(twins, lr=1e-3, betas=tuple(cfg.train.betas), weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in params]
    for _ in range(3):
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        policy.optimizer.step()
        reference.step()
    moved = sum((p.detach() - s).abs().sum().item() for p, s in zip(params, start)) / sum(p.numel() for p in params)
    worst = max(((p.detach() - q.detach()).abs().max().item() for p, q in zip(params, twins)))
    report(f"d adamw {device} {dtype}", mean_step=moved, max_abs_diff=worst)
    # a constant gradient makes each bias-corrected Adam step exactly lr per weight (decay adds ~1e-4 of it)
    assert moved == pytest.approx(3e-3, rel=0.01)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(policy.optimizer.state[p]["exp_avg"], reference.state[q]["exp_avg"])
        torch.testing.assert_close(policy.optimizer.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"])


# ---- e: LoRA -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_lora_trains_only_adapters_and_the_merged_export_gives_its_logits(tiny_model_dir, tmp_path, device):
    """Two updates at lr 0.05 move the adapters well away from the base. The export (W + scale B A, float32)
    runs the same matmuls grouped differently from the trainer's W x + scale B (A x): 1e-5 on the CPU
    (tests/test_lora.py), 1e-4 on CUDA for its other kernels' summation order (logits here are ~1)."""
    from transformers import AutoModelForCausalLM

    from test_lora import LORA, adapter_params, base_params, sampled

    cfg = small_config(tmp_path, tiny_model_dir, *LORA)
    torch.manual_seed(0)
    policy = make_policy(cfg, device)
    for group in policy.optimizer.param_groups:
        group["lr"] = 0.05
    batch = sampled(policy)
    before_base, before_adapters = base_params(policy.model), adapter_params(policy.model)
    for _ in range(2):
        policy.update(batch, loss_fn_of(cfg))
    after_base, after_adapters = base_params(policy.model), adapter_params(policy.model)
    assert [n for n in before_base if not torch.equal(before_base[n], after_base[n])] == []
    moved = [n for n in before_adapters if not torch.equal(before_adapters[n], after_adapters[n])]
    assert len(moved) == len(before_adapters) == 28
    step = checkpoint.save_checkpoint(
        tmp_path / "run", 2, model=policy.model, tokenizer=policy.tokenizer, trainer_state={}, config_yaml="", keep=1
    )
    ids = torch.tensor([policy.tokenizer("12+7*3=")["input_ids"]], device=device)
    with torch.no_grad():
        want = policy.model(input_ids=ids).logits[0].float()
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device)
        assert (want - base(input_ids=ids).logits[0].float()).abs().max() > 1e-2  # not the base's logits
        assert cli.main(["export", str(step), str(tmp_path / "merged")]) == 0
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").to(device)
        diff = (merged(input_ids=ids).logits[0].float() - want).abs().max().item()
    report(f"e lora {device}", merged_logit_max_abs_diff=diff)
    assert diff < (1e-5 if device == "cpu" else 1e-4)


# ---- f: stop hard at checkpoint k, resume ---------------------------------------------------------
HARD_EXIT = [
    "train.total_steps=3",
    "run.save_every=1",
    "algo.dynamic_sampling=true",
    "algo.filter_metric=reward",
    "algo.max_gen_rounds=3",
    "algo.oversample=3.0",
    "algo.held_over_max_groups=8",
    "run.async_checkpoint=true",
]


def driver(run_dir, model_dir, saves, tag, kill_after, device):
    cmd = [
        sys.executable,
        str(REPO / "tests" / "train_until_checkpoint.py"),
        str(run_dir),
        str(model_dir),
        str(saves),
        tag,
        str(kill_after),
        *HARD_EXIT,
        f"model.device={device}",
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=env_for_children(COLUMNS="500"), capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("device", HEAVY_DEVICES)
def test_hard_stop_after_a_checkpoint_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path, device):
    """3 steps uninterrupted against: os._exit right after checkpoint 1, then a fresh process resuming. The
    RNG (CUDA's too), sampler, held-over groups and AdamW state resume, and each run issues the same kernels
    in the same order, so on the CPU the weights must be bit-identical. On CUDA some kernels add floats
    atomically in whatever order threads arrive (the memory-efficient and flash attention backward, scatter-adds),
    so two uninterrupted runs may already differ: there the uninterrupted run goes twice, and the resumed run
    must be bit-identical where those two are, else within 10x their own difference (a resume bug, a lost
    AdamW state or RNG, shows as a difference of the order of a step, ~1e-3, against rounding's ~1e-7)."""
    from safetensors.torch import load_file

    def final(run: str):
        return load_file(str(tmp_path / run / "t" / "checkpoints" / "step_000003" / "model" / "model.safetensors"))

    def max_diff(x: dict, y: dict) -> float:
        assert x.keys() == y.keys()
        return max((x[k].float() - y[k].float()).abs().max().item() for k in x)

    refs = ["a", "a2"] if device == "cuda" else ["a"]
    for run in refs:
        ref = driver(tmp_path / run, tiny_model_dir, tmp_path / f"{run}.txt", "ref", 0, device)
        assert ref.returncode == 0, ref.stderr[-3000:]
    killed = driver(tmp_path / "b", tiny_model_dir, tmp_path / "b.txt", "killed", 1, device)
    assert killed.returncode == 1, killed.stderr[-3000:]
    resumed = driver(tmp_path / "b", tiny_model_dir, tmp_path / "b.txt", "resumed", 0, device)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and (tmp_path / "b.txt").read_text().split() == [
        "killed",
        "1",
        "resumed",
        "2",
        "resumed",
        "3",
    ]
    want, got = final("a"), final("b")
    differing = [k for k in want if not torch.equal(want[k], got[k])]
    figures = {"tensors": len(want), "differing": len(differing), "resumed_max_abs_diff": max_diff(want, got)}
    if device == "cuda":
        figures["rerun_max_abs_diff"] = max_diff(want, final("a2"))
    report(f"f resume {device}", **figures)
    if figures.get("rerun_max_abs_diff", 0.0) == 0.0:
        assert differing == [], figures  # deterministic here: nothing may differ
    else:
        assert figures["resumed_max_abs_diff"] <= 10 * figures["rerun_max_abs_diff"], figures


# ---- g: peak memory per phase --------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_phase_peaks_are_the_allocators_peaks(device):
    """CUDA: a phase's perf/peak_cuda_<phase>_gb is exactly torch.cuda.max_memory_allocated at its end
    (reset as it opens), the enclosing phase gets the larger, and a later phase does not inherit an earlier
    one's peak. CPU: no CUDA names at all, the resident-set ones only."""
    from dapo.runtime.memory import GIB, PhaseMemory

    mem = PhaseMemory(interval_s=0.001, cuda=device == "cuda")
    mem.enter("step")
    mem.enter("update")
    block = torch.ones(64 * 2**20, device=device)  # 256 MiB of float32
    at_exit = torch.cuda.max_memory_allocated() if device == "cuda" else None
    mem.exit("update")
    del block
    mem.enter("eval")
    small = torch.ones(2**20, device=device)  # 4 MiB
    mem.exit("eval")
    mem.exit("step")
    peaks = mem.take()
    mem.close()
    del small
    if device == "cpu":
        assert not any("cuda" in k for k in peaks) and "perf/peak_rss_update_gb" in peaks
        return
    report("g phase-memory cuda", **peaks, max_memory_allocated_at_update_exit=at_exit / GIB)
    assert peaks["perf/peak_cuda_update_gb"] == at_exit / GIB
    assert peaks["perf/peak_cuda_update_gb"] * GIB >= 256 * 2**20
    assert peaks["perf/peak_cuda_eval_gb"] * GIB < peaks["perf/peak_cuda_update_gb"] * GIB - 200 * 2**20
    assert peaks["perf/peak_cuda_step_gb"] == peaks["perf/peak_cuda_update_gb"]


@pytest.mark.parametrize("device", HEAVY_DEVICES)
def test_a_training_run_logs_each_phases_peak(tiny_model_dir, tmp_path, device):
    """Two steps of the loop: every phase's peak is logged under its name, none above the step's, and on
    CUDA at least the model's weights and gradients (they are allocated throughout the update)."""
    from dapo.training import train

    cfg = small_config(tmp_path, tiny_model_dir, f"model.device={device}")
    train(cfg)
    rows = read_metrics(cfg.run_dir)
    kind = "cuda" if device == "cuda" else "rss"
    phases = ("step", "collect", "old_logprob", "update", "weight_sync")
    params = sum(v.numel() for v in load_weights(tiny_model_dir).values())
    for r in rows:
        peaks = {p: r[f"perf/peak_{kind}_{p}_gb"] for p in phases}
        assert all(0 < v <= peaks["step"] for v in peaks.values()), peaks
        assert device == "cuda" or not any(k.startswith("perf/peak_cuda_") for k in r)
        if device == "cuda":
            assert peaks["update"] * 2**30 >= 2 * 4 * params  # float32 weights and gradients
            report("g training-run cuda", **{k: v for k, v in r.items() if k.startswith("perf/peak_cuda_")})


def load_weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.mark.parametrize("device", HEAVY_DEVICES)  # the CPU side: tests/test_rollout.py, test_arch_matrix.py
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_loop_samples_generates_tokens_on_the_device(device, dtype):
    """Item u: on the demo's base model (answers end at different lengths, so rows leave the batch), 4 prompts of 6
    rows each, the engine's own loop (rollout/hf_decode.py) and transformers' generate draw the same tokens for the
    seed. A smaller forward batch may round the last bit differently; a draw falls on such an edge about once in
    millions of tokens."""
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(REPO / "assets" / "arith-base", dtype=dtype, device=device)
    loop, plain = HFRolloutEngine(model, tok), HFRolloutEngine(model, tok, compacting=False)
    assert loop.compacting and not plain.compacting
    prompts = [tok.encode(p) for p in ("1+2=", "12*3-4=", "7=", "(5+6)*7-8=")]
    params = SamplingParams(n=6, temperature=1.0, max_new_tokens=24, seed=0)
    a, b = loop.generate(prompts, params), plain.generate(prompts, params)
    lengths = [len(r) for r in a.response_ids]
    same = sum(x == y for x, y in zip(a.response_ids, b.response_ids))
    report("u", device=device, dtype=dtype, rows=len(lengths), same_rows=same, lengths=[min(lengths), max(lengths)])
    assert a.response_ids == b.response_ids and torch.equal(a.truncated, b.truncated)
    assert min(lengths) < max(lengths)  # rows ended at different steps: the batch shrank


@pytest.mark.parametrize("device", HEAVY_DEVICES)  # the CPU side: tests/test_async_rollout.py
def test_the_rollout_process_samples_on_the_device_what_the_engine_in_process_does(tiny_model_dir, device):
    """Item m: with the same weights (version 1, pushed) and seed, the rollout process gives the in-process engine's
    tokens, and log-probs within 1e-5 (the same kernels in another process; the model's own forward)."""
    from dapo.config import load_config
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.build import engine_of_its_own
    from dapo.rollout.hf import HFRolloutEngine
    from dapo.rollout.remote import RemoteEngine

    cfg = load_config("configs/demo.yaml", [f"model.path={tiny_model_dir}"])
    model, tok = load_model_and_tokenizer(tiny_model_dir, device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=3)
    prompts = [tok.encode("12+30="), tok.encode("7*8=")]
    here = HFRolloutEngine(model, tok, logprobs=True).generate(prompts, params)
    remote = RemoteEngine(engine_of_its_own, cfg.rollout, cfg.model, tok, max_model_len=64, threads=1, device=device)
    try:
        remote.update_weights(model.named_parameters(), version=1)
        remote.use_version(1)
        there = remote.generate(prompts, params)
    finally:
        remote.close()
    gap = max(abs(a - b) for x, y in zip(here.logprobs, there.logprobs) for a, b in zip(x, y))
    report("m", device=device, same_tokens=there.response_ids == here.response_ids, logprob_gap=gap, bound=1e-5)
    assert there.response_ids == here.response_ids
    assert gap <= 1e-5


@pytest.mark.parametrize("device", HEAVY_DEVICES)  # the CPU side: tests/test_rollout_ranks.py
def test_a_rollout_rank_on_the_device_trains_as_the_rollout_process_does(tiny_model_dir, tmp_path, device):
    """Item n: torchrun, 2 ranks on the device (one GPU: both on it), the second a rollout rank (rollout.ranks=1), at
    rollout.max_staleness=1, against one trainer with its rollout process: the same samples every step, and final
    weights within 1e-5 (CUDA's backward may sum in another order from run to run)."""
    from test_rollout_ranks import ASYNC, rows, run, weights

    on = [*ASYNC, f"model.device={device}", "run.save_every=3"]
    run(tiny_model_dir, tmp_path / "process", *on)
    run(tiny_model_dir, tmp_path / "ranks", *on, "rollout.ranks=1", nproc=2)
    ref, got = rows(tmp_path / "process"), rows(tmp_path / "ranks")
    same = all(got[t]["rollout/response_length_mean"] == ref[t]["rollout/response_length_mean"] for t in (1, 2, 3))
    a, b = weights(tmp_path / "process", 3), weights(tmp_path / "ranks", 3)
    gap = max((a[n] - b[n]).abs().max().item() for n in a)
    report("n", device=device, same_samples=same, weight_gap=gap, bound=1e-5)
    assert same and [got[t]["async/staleness_max"] for t in (1, 2, 3)] == [0, 1, 1]
    assert gap <= 1e-5


# ---- v: the first update's old log-probs from its own forward ------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_old_logp_from_update_on_the_device_gives_the_passs_old_log_probs(tiny_model_dir, tmp_path, device, dtype):
    """algo.old_logp_from_update on the device: the pass leaves out the first update's rows, whose forward writes
    their old log-probs and entropy before its optimizer step (that update's ratio exactly 1), and every old log-prob,
    entropy and update statistic matches a pass over every row (float32: 1e-5; bf16: the passes round differently,
    a few of its epsilons)."""
    from conftest import sampled_batch
    from dapo.algorithm.step import first_update_rows

    cfg = small_config(
        tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=1", f"model.dtype={dtype}"
    )
    out = {}
    for from_update in (False, True):
        torch.manual_seed(0)
        policy = make_policy(cfg, device)
        batch = sampled_batch(policy)  # the same samples both times: the same weights and seed
        rows = first_update_rows(batch, policy) if from_update else []
        batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True, skip=rows)
        assert not batch.old_logp[rows].any()
        real, ratios = loss_fn_of(cfg), []

        def spy(logp, old, *args, real=real, ratios=ratios, **kwargs):
            ratios.append((logp.detach().float() - old).exp())
            return real(logp, old, *args, **kwargs)

        stats = policy.update(batch, spy, old_logp_rows=rows)
        out[from_update] = (batch.old_logp, batch.entropy, stats, ratios, rows)
    (old_pass, ent_pass, stats_pass, _, _), (old, ent, stats, ratios, rows) = out[False], out[True]
    assert rows == [0, 1, 2, 3] and len(ratios) == 3
    assert torch.equal(ratios[0], torch.ones_like(ratios[0]))  # the first update's own forward
    tol = 1e-5 if dtype == "float32" else 16 * BF16_EPS
    logp_diff, ent_diff = (old - old_pass).abs().max().item(), (ent - ent_pass).abs().max().item()
    report(f"v old_logp_from_update {device} {dtype}", logp_max_abs_diff=logp_diff, entropy_max_abs_diff=ent_diff)
    assert old_pass[:4].abs().max() > 0.1 and logp_diff < tol and ent_diff < tol
    for name in ("pg_loss", "grad_norm"):
        assert stats[name].item() == pytest.approx(stats_pass[name].item(), rel=tol, abs=tol), name
