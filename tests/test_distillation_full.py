"""teacher.signal=full: the exact KL(student || teacher) over the whole vocabulary at each trained token, in the loss.
Its head function against autograd over full logits, the update's term against both models' own forwards over the
whole sequence (SmolLM2's real tokenizer, three micro-batch layouts), and runs of it (pure distillation, DAPO + the
teacher's KL; under FSDP: tests/test_distillation.py's two-rank launch)."""

import pytest
import torch

from conftest import SMALL_OVERRIDES, sampled_batch
from dapo.config import ConfigError, load_config
from dapo.model.logits import LogitTransform
from test_distillation import teacher_of


def _kl_reference(h, w, q, temperature, transform):
    logp = (transform(h @ w.t()) / temperature).log_softmax(-1)
    return (logp.exp() * (logp - q)).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)], ids=["plain", "cap"])
def test_head_reverse_kl_equals_the_full_distributions_kl_and_its_gradient(chunk, transform):
    from dapo.model.logprobs import HeadReverseKL

    torch.manual_seed(0)
    n, H, V, T = 23, 16, 50, 0.7
    h0, w0 = torch.randn(n, H), torch.randn(V, H) * 0.5
    q = torch.randn(n, V).log_softmax(-1)  # the teacher's log-probs
    upstream = torch.randn(n)  # an arbitrary loss: sum_t u_t * KL_t
    results = []
    for fused in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        kl = HeadReverseKL.apply(h, w, q, T, chunk, transform) if fused else _kl_reference(h, w, q, T, transform)
        (upstream * kl).sum().backward()
        results.append((kl.detach(), h.grad, w.grad))
    for fused, ref in zip(*results):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    assert results[0][2].abs().max() > 1e-2  # a gradient that means something
    # by hand, one row in float64: sum_v p_v (log p_v - log q_v)
    p = torch.softmax(transform(h0[3].double() @ w0.t().double()) / T, -1)
    by_hand = sum(p[v] * (p[v].log() - q[3, v].double()) for v in range(V))
    assert abs(results[0][0][3].item() - by_hand.item()) < 1e-5 and by_hand > 0.1


@pytest.mark.parametrize(
    "layout", [[], ["train.share_prompt_prefix=true"], ["train.max_tokens_per_micro_batch=40"]],
    ids=["one-pass", "shared-prompts", "micro-batches"],
)  # fmt: skip
def test_the_update_adds_the_kl_of_both_models_own_forwards_and_its_gradient(real_tokenizer_dirs, tmp_path, layout):
    """Sampled rows of the student (SmolLM2's byte-level BPE, 49,152 tokens), each micro-batch's forward and backward
    with the full teacher: the term added to the loss is, per trained token, KL(softmax(student logits / T) ||
    softmax(teacher logits / T)) from both models' own forwards over the whole sequence, its token mean over the
    mini-batch, and its gradient that of that mean (the policy loss set to 0 here)."""
    student_dir, teacher_dir = real_tokenizer_dirs
    cfg = load_config(
        "configs/demo.yaml",
        [f"model.path={student_dir}", *SMALL_OVERRIDES, f"teacher.path={teacher_dir}", "teacher.coef=1"]
        + ["teacher.signal=full", "rollout.temperature=0.7", *layout],
    )
    student, teacher = teacher_of(cfg)
    batch = sampled_batch(student)
    rows = list(range(len(batch)))
    mask = batch.response_mask(width=batch.max_response_len)
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum()}
    no_policy_loss = lambda logp, *args, **kw: ((logp * 0).sum(), {})  # noqa: E731
    stats, kl_means = {}, []
    student.model.zero_grad()
    for micro in student.micro_batches(batch, rows):
        stats = student._micro_batch_backward(batch, micro, no_policy_loss, counts, None, (teacher, 2.0))
        kl_means.append((stats["teacher/reverse_kl_mean"][0] * stats["teacher/reverse_kl_mean"][1]).item())
    got_grads = {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}
    student.model.zero_grad()

    total = torch.zeros(())
    for i in rows:  # by hand: both models' own forwards over the whole sequence
        prompt, response = batch.prompt_ids[i], batch.response_ids[i]
        ids = torch.tensor([prompt + response])
        logp_s = (student.model(ids).logits[0].float() / 0.7).log_softmax(-1)[len(prompt) - 1 : -1]
        with torch.no_grad():
            logp_t = (teacher.model(ids).logits[0].float() / 0.7).log_softmax(-1)[len(prompt) - 1 : -1]
        total = total + ((logp_s.exp() * (logp_s - logp_t)).sum(-1) * mask[i, : len(response)]).sum()
    (2.0 * total / counts["num_tokens"]).backward()
    assert sum(kl_means) == pytest.approx(total.item(), rel=1e-5) and total.item() > 0.1
    for name, want in ((n, p.grad) for n, p in student.model.named_parameters() if p.grad is not None):
        torch.testing.assert_close(got_grads[name], want, rtol=1e-4, atol=1e-6)
    assert len(got_grads) > 0 and all(p.grad is None for p in teacher.model.parameters())  # the teacher is frozen


@pytest.mark.parametrize("reward_advantage", ["false", "true"], ids=["pure", "dapo+teacher"])
def test_a_run_trains_on_the_teachers_kl_and_logs_it(tiny_model_dir, teacher_dir, tmp_path, reward_advantage):
    """Two steps: the teacher's KL is logged from the update, with no sampled-token term (no teacher pass before
    the update, no share of the advantage); pure distillation trains on every group (no dynamic sampling
    filter, though dynamic sampling is on) with a policy loss of 0, DAPO + teacher with the reward's."""
    from dapo.training import train
    from test_async_rollout import rows_of

    extra = [f"teacher.path={teacher_dir}", "teacher.coef=1", "teacher.signal=full"]
    extra += [f"teacher.reward_advantage={reward_advantage}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path}"]
    sampling = "algo.dynamic_sampling=true" if reward_advantage == "false" else "algo.dynamic_sampling=false"
    train(load_config("configs/demo.yaml", [*SMALL_OVERRIDES, sampling, *extra]))
    rows = [r for r in rows_of(tmp_path) if "sampling/tokens_trained" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["teacher/reverse_kl_mean"] > 0 and "teacher/adv_share" not in r
        assert "perf/time_teacher_logprob_s" not in r and "actor/teacher/reverse_kl_mean" not in r
        if reward_advantage == "false":
            assert r["actor/pg_loss"] == 0 and r["sampling/gen_rounds"] == 1


def test_a_full_signal_without_a_teacher_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^teacher.signal=full: teacher.coef=0 turns the teacher off, so its KL "):
        load_config("configs/demo.yaml", ["teacher.signal=full"])
    with pytest.raises(ConfigError, match=r"^teacher.signal='dense': choose sampled or full$"):
        load_config("configs/demo.yaml", ["teacher.signal=dense"])
