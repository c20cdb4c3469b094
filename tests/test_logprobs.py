"""The trainer's log-probs on a tiny model: per token as the full forward gives them, packed or padded, through the
chunked LM head, under the micro-batch plan; the frozen reference's."""

import pytest
import torch

from conftest import loss_fn_of, make_policy, sampled_batch, small_config
from dapo.model.logprobs import token_logprobs
from dapo.model.micro_batch import make_micro_batch, plan_micro_batches


def test_token_logprobs_match_full_forward(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = list(range(len(batch)))
    mb = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    with torch.no_grad():
        logp, ent = token_logprobs(policy.model, mb, temperature=0.7, with_entropy=True, chunk_tokens=7)
        logits = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / 0.7
    full = torch.log_softmax(logits, -1)
    for i in rows:
        p = len(batch.prompt_ids[i])
        for t, tok in enumerate(batch.response_ids[i]):
            assert logp[i, t].item() == pytest.approx(full[i, p + t - 1, tok].item(), abs=1e-5)
            probs = full[i, p + t - 1].exp()
            assert ent[i, t].item() == pytest.approx(-(probs * full[i, p + t - 1]).sum().item(), abs=1e-4)
    # with gradients on (the update's checkpointed head) the same numbers, the entropy detached, each
    # chunk's computed once: backward's recomputation of a chunk appends nothing
    logp_g, ent_g = token_logprobs(policy.model, mb, temperature=0.7, with_entropy=True, chunk_tokens=7)
    assert logp_g.requires_grad and not ent_g.requires_grad
    logp_g.sum().backward()
    assert torch.allclose(logp_g.detach(), logp, atol=1e-6) and torch.equal(ent_g, ent)


def test_packed_micro_batch_gives_the_padded_log_probs(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = [5, 0, 7, 2]  # any order: results come back per row
    padded = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    packed = make_micro_batch(batch, rows, policy.pad_id, "cpu", packed=True)
    assert packed.input_ids.shape == (1, sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows))
    assert packed.num_tokens < padded.num_tokens or len({len(batch.response_ids[i]) for i in rows}) == 1
    with torch.no_grad():
        a, ea = token_logprobs(policy.model, padded, temperature=1.0, with_entropy=True)
        b, eb = token_logprobs(policy.model, packed, temperature=1.0, with_entropy=True)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-4)
    assert (a[0, len(batch.response_ids[5]) :] == 0).all()  # padding positions stay zero


def test_chunked_head_gradient_matches_full_logits(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = list(range(len(batch)))
    mb = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    weights = torch.randn(len(rows), mb.width)  # an arbitrary loss: sum_t w_t * logp_t
    grads = []
    for chunk in (5, None):
        policy.model.zero_grad()
        if chunk:  # checkpointed chunks of 5 tokens
            logp, _ = token_logprobs(policy.model, mb, temperature=0.9, chunk_tokens=chunk)
        else:  # reference: the full (B, L, V) logits
            logits = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / 0.9
            full = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])[mb.token_index]
            flat = full.gather(-1, mb.targets[:, None]).squeeze(-1)
            logp = flat.new_zeros(len(rows) * mb.width).index_put((mb.out_index,), flat).view(len(rows), mb.width)
        (weights * logp).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    assert grads[0].abs().max() > 1e-3
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def _head_reference(h, weight, targets, temperature):
    """log-probs and entropies from the full logits, through plain autograd."""
    logits = (h @ weight.t()).float() / temperature  # (n, V)
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_head_logprobs_equal_full_logits_values_and_gradients(chunk):
    from dapo.model.logprobs import HeadLogProbs

    torch.manual_seed(0)
    n, H, V, T = 23, 16, 50, 0.7
    h0, w0 = torch.randn(n, H), torch.randn(V, H) * 0.5
    targets = torch.randint(0, V, (n,))
    upstream = torch.randn(n)  # an arbitrary loss: sum_t u_t * logp_t
    grads = []
    for fused in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            logp, entropy = HeadLogProbs.apply(h, w, targets, T, chunk, True)
        else:
            logp, entropy = _head_reference(h, w, targets, T)
        (upstream * logp).sum().backward()
        grads.append((logp.detach(), entropy.detach(), h.grad, w.grad))
    for fused, ref in zip(*grads):
        assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5)
    assert grads[0][3].abs().max() > 1e-2  # a gradient that means something
    # by hand, one row: d logp_t / d logits = one-hot(target) - softmax, through the division by T
    p = torch.softmax((h0[0] @ w0.t()) / T, -1)
    d_logits = (torch.nn.functional.one_hot(targets[0], V) - p) * upstream[0] / T  # (V,)
    assert torch.allclose(grads[0][2][0], d_logits @ w0, atol=1e-5)


def test_head_logprobs_leave_a_frozen_head_without_gradient_and_keep_its_dtype():
    from dapo.model.logprobs import HeadLogProbs

    torch.manual_seed(0)
    h, targets = torch.randn(9, 8, requires_grad=True), torch.randint(0, 30, (9,))
    frozen = torch.randn(30, 8)  # e.g. under LoRA: only the layers below train
    logp, entropy = HeadLogProbs.apply(h, frozen, targets, 1.0, 4, False)
    logp.sum().backward()
    assert h.grad is not None and entropy.numel() == 0
    w16 = torch.randn(30, 8, dtype=torch.bfloat16, requires_grad=True)
    logp, _ = HeadLogProbs.apply(h.detach().bfloat16(), w16, targets, 1.0, 4, False)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert w16.grad.dtype == torch.bfloat16
    ref, _ = _head_reference(h.detach().bfloat16(), w16.detach().requires_grad_(), targets, 1.0)
    assert torch.allclose(logp.detach(), ref, atol=1e-3)


def test_head_chunk_keeps_cpu_logits_under_glibcs_mmap_ceiling():
    from dapo.model.logprobs import head_chunk_rows

    assert head_chunk_rows(49152, torch.device("cpu")) == 128  # SmolLM2: 128 x 49152 x 4 B = 24 MiB
    assert head_chunk_rows(151936, torch.device("cpu")) == 64  # Qwen2.5: 41 rows would slow the matmuls
    assert head_chunk_rows(258, torch.device("cpu")) * 258 * 4 <= 24 * 2**20
    assert head_chunk_rows(151936, torch.device("cuda")) == 1024


def test_micro_batch_plan_respects_the_budget_and_balances():
    lengths = [10, 9, 3, 2, 2]
    assert plan_micro_batches(lengths, 20) == [[0, 1], [2, 3, 4]]  # 2 x 10 and 3 x 3 padded tokens
    assert plan_micro_batches([4] * 6, 20) == [[0, 1, 2], [3, 4, 5]]  # not 5 + 1
    assert plan_micro_batches([4] * 6, 20, packed=True) == [[0, 1, 2], [3, 4, 5]]
    assert plan_micro_batches([30, 2], 20) == [[0], [1]]  # a row over the budget goes alone
    assert plan_micro_batches([4] * 6, 100, max_rows=2) == [[0, 1], [2, 3], [4, 5]]
    import random

    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        for packed in (False, True):
            plan = plan_micro_batches(lens, 64, packed=packed)
            assert sorted(i for c in plan for i in c) == list(range(len(lens)))
            for c in plan:
                cost = sum(lens[i] for i in c) if packed else len(c) * max(lens[i] for i in c)
                assert cost <= 64 or len(c) == 1


def test_reference_model_gives_the_initial_policys_log_probs(tiny_model_dir, tmp_path):
    from dapo.model.policy import ReferenceModel

    cfg = small_config(
        tmp_path, tiny_model_dir, "algo.kl_coef=0.05", "rollout.temperature=0.8", "train.max_tokens_per_micro_batch=60"
    )
    policy = make_policy(cfg)
    reference = ReferenceModel(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    assert not hasattr(policy, "ref_model")
    assert not any(p.requires_grad for p in reference.model.parameters())
    batch = sampled_batch(policy)
    ref_logp = reference.logprobs(batch)  # (N, T)
    assert torch.equal(ref_logp, policy.compute_logprobs(batch)[0])
    batch.ref_logp = ref_logp
    policy.update(batch, loss_fn_of(cfg))
    assert torch.equal(reference.logprobs(batch), ref_logp)  # frozen
    assert (policy.compute_logprobs(batch)[0] - ref_logp).abs().max() > 1e-3
