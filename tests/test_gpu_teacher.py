"""Item o of `make gpu-check`: the teacher pass of on-policy distillation on the device. The teacher (teacher.path,
frozen) scores the student's sampled rows on the device, float32 and with teacher.dtype=bfloat16, against the same
teacher's float32 log-probs on the CPU; on the CPU (`make test`) the float32 side is the CPU against itself and the
bf16 side the CPU's bf16 kernels."""

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
