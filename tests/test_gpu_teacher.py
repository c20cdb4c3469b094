"""Item o of `make gpu-check`: the teacher pass of on-policy distillation on the device. The teacher (teacher.path,
frozen) scores the student's sampled rows on the device, float32 and with teacher.dtype=bfloat16, against the same
teacher's float32 log-probs on the CPU; on the CPU (`make test`) the float32 side is the CPU against itself and the
bf16 side the CPU's bf16 kernels. With teacher.signal=full, the student's KL to the teacher's distribution over the
vocabulary (HeadReverseKL) on the device against full logits, as item c checks HeadLogProbs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES, sampled_batch  # noqa: E402
from dapo.config import load_config  # noqa: E402
from test_gpu import BF16_EPS, DEVICES, report  # noqa: E402


def teacher_on(cfg, device: str, student_tokenizer):
    from dapo.model.teacher import TeacherModel

    return TeacherModel(
        cfg.teacher, cfg.model, cfg.train, student_tokenizer=student_tokenizer,
        temperature=cfg.rollout.temperature, device=torch.device(device),
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_teacher_pass_on_the_device_gives_its_cpu_float32_log_probs(
    tiny_model_dir, other_tiny_model_dir, device, dtype
):
    from dapo.model.policy import Policy

    cfg = load_config(
        "configs/demo.yaml",
        [f"model.path={tiny_model_dir}", *SMALL_OVERRIDES, f"teacher.path={other_tiny_model_dir}", "teacher.coef=1",
         "rollout.temperature=0.7", f"teacher.dtype={dtype}", "train.share_prompt_prefix=true"],
    )  # fmt: skip
    student = Policy(cfg.model, cfg.train, temperature=0.7, device=torch.device("cpu"))
    batch = sampled_batch(student)
    mask = batch.response_mask(torch.arange(len(batch)), width=batch.max_response_len).bool()
    plain = [f"model.path={tiny_model_dir}", f"teacher.path={other_tiny_model_dir}", "teacher.coef=1"]
    reference = load_config("configs/demo.yaml", [*plain, "rollout.temperature=0.7"])
    want = teacher_on(reference, "cpu", student.tokenizer).logprobs(batch)[mask]  # float32 on the CPU, unshared
    teacher = teacher_on(cfg, device, student.tokenizer)
    assert all(not p.requires_grad and p.device.type == device for p in teacher.model.parameters())
    got = teacher.logprobs(batch)[mask]
    # float32: the kernels' rounding; bf16 weights and activations: two roundings of each log-prob's size (plus 1)
    bound = torch.full_like(want, 1e-4) if dtype == "float32" else 2 * BF16_EPS * (1 + want.abs())
    gap = (got - want).abs()
    report("o", device=device, dtype=dtype, max_gap=gap.max().item(), worst_to_bound=(gap / bound).max().item(),
           tokens=int(mask.sum()))  # fmt: skip
    assert (gap <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_teacher_pass_on_the_device_as_the_full_kl_against_full_logits(device, dtype):
    """teacher.signal=full's head function on the device: KL(student || teacher) over a 3,000-token vocabulary at each
    row and its gradients, over 2 full chunks and a partial one (CUDA_HEAD_CHUNK_ROWS on CUDA; 300 rows on the CPU),
    against the full (n, V) logits through autograd from the same dtype's inputs. float32: 2e-5; bf16: the logits'
    rounding (BF16_EPS of the largest, over the temperature) on the KL's scale, gradients within 2% of their largest
    entry, as item c bounds HeadLogProbs."""
    from dapo.model.logits import LogitTransform
    from dapo.model.logprobs import CUDA_HEAD_CHUNK_ROWS, HeadReverseKL, head_chunk_rows

    V, H, T = 3000, 64, 0.8
    chunk = head_chunk_rows(V, torch.device(device)) if device == "cuda" else 300
    n = 2 * chunk + 37
    gen = torch.Generator().manual_seed(0)
    h0, w0 = torch.randn(n, H, generator=gen), torch.randn(V, H, generator=gen) * 0.25  # logits ~ N(0, 4)
    q = (torch.randn(n, V, generator=gen) * 2).log_softmax(-1)  # the teacher's log-probs, float32 as the pass gives
    upstream = torch.randn(n, generator=gen)
    dt = getattr(torch, dtype)
    out = []
    for fused in (True, False):
        h, w = h0.to(device, dt).requires_grad_(), w0.to(device, dt).requires_grad_()
        if fused:
            kl = HeadReverseKL.apply(h, w, q.to(device), T, chunk, LogitTransform())
        else:
            logp = ((h @ w.t()).float() / T).log_softmax(-1)
            kl = (logp.exp() * (logp - q.to(device))).sum(-1)
        (upstream.to(device) * kl).sum().backward()
        out.append([t.detach().float().cpu() for t in (kl, h.grad, w.grad)])
    (kl, gh, gw), (kl_r, gh_r, gw_r) = out
    scale = (h0 @ w0.t()).abs().max().item() / T
    tol = 2e-5 if dtype == "float32" else 4 * BF16_EPS * scale
    found = {
        "kl_diff": (kl - kl_r).abs().max().item(),
        "grad_h_rel": ((gh - gh_r).abs().max() / gh_r.abs().max()).item(),
        "grad_w_rel": ((gw - gw_r).abs().max() / gw_r.abs().max()).item(),
        "kl_mean": kl_r.mean().item(),
        "chunk": chunk,
        "rows": n,
        "kl_bound": tol,
    }
    report(f"o full-kl {device} {dtype}", **found)
    assert found["kl_diff"] <= tol and kl_r.mean() > 1.0, found
    assert found["grad_h_rel"] <= (1e-5 if dtype == "float32" else 0.02), found
    assert found["grad_w_rel"] <= (1e-5 if dtype == "float32" else 0.02), found
    assert device == "cpu" or chunk == CUDA_HEAD_CHUNK_ROWS
