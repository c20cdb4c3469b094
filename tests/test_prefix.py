"""train.share_prompt_prefix: each distinct prompt of a micro-batch computed once, its responses
attending to that one copy. The same log-probs, entropies, gradients and updates as recomputing the
prompt per row, on Llama and Qwen2, eager and sdpa attention, prompts of 50-150 tokens."""

import random

import pytest
import torch

from conftest import loss_fn_of, make_policy, small_config
from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.config import ConfigError
from dapo.model import tiny
from dapo.model.logprobs import token_logprobs
from dapo.model.micro_batch import make_micro_batch, plan_shared_prompt_micro_batches, response_passes
from dapo.model.prefix import unsupported

PROMPT_LENGTHS = (57, 143, 96, 71)  # one group each
RESPONSE_LENGTHS = ((1, 9, 30, 2), (17, 1, 1, 40), (5, 23, 8, 12), (33, 3, 19, 1))  # length 1 in most groups


def synthetic_batch(prompt_lengths=PROMPT_LENGTHS, response_lengths=RESPONSE_LENGTHS, *, vocab=258, seed=0):
    """Groups of random token ids: the rows of a group share their prompt, as sampling leaves them."""
    rng = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for p, lengths in zip(prompt_lengths, response_lengths):
        prompt = torch.randint(2, vocab, (p,), generator=rng).tolist()
        for r in lengths:
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (r,), generator=rng).tolist())
    n, g = len(responses), len(response_lengths[0])
    reward = torch.tensor([1.0 if (i * 7) % 3 == 0 else -1.0 for i in range(n)])
    batch = RolloutBatch.of_responses(prompts, responses, group_size=g, reward=reward)
    batch.adv = advantages.group_advantages(reward, g)
    return batch


def tiny_lm(arch: str, attention: str, *, gradient_checkpointing: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    return lm


# rows out of order (row 4 ahead of group 0, row 13 inside group 2): results come back per row, whatever the order
ROWS = [4, 0, 1, 2, 3, 5, 6, 7, 13, 8, 9, 10, 11, 12, 14, 15]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_shared_prompts_give_the_unshared_log_probs_and_entropies(arch, attention):
    lm = tiny_lm(arch, attention).eval()
    batch = synthetic_batch()
    unshared = make_micro_batch(batch, ROWS, 0, "cpu")
    shared = make_micro_batch(batch, ROWS, 0, "cpu", share_prompts=True)
    assert shared.shared.input_ids.shape == (4, 143)  # 4 distinct prompts, padded to the longest
    # every response but its last token, in passes of similar width: 39-22, 18-7 and 4-1 tokens
    assert [part.input_ids.shape for part in shared.shared.responses] == [(4, 39), (5, 18), (7, 4)]
    assert shared.num_tokens == 4 * 143 + 4 * 39 + 5 * 18 + 7 * 4
    with torch.no_grad():
        logp, ent = token_logprobs(lm, unshared, temperature=0.7, with_entropy=True, chunk_tokens=50)
        logp_s, ent_s = token_logprobs(lm, shared, temperature=0.7, with_entropy=True, chunk_tokens=50)
    assert logp.shape == logp_s.shape == (16, 40)
    lengths = torch.tensor([len(batch.response_ids[i]) for i in ROWS])
    inside = torch.arange(40)[None, :] < lengths[:, None]
    assert (logp_s[~inside] == 0).all() and (logp_s[inside] < 0).all()
    assert (logp_s - logp).abs().max().item() < 1e-5
    assert (ent_s - ent).abs().max().item() < 1e-5
    assert ent[inside].min().item() > 1.0  # a random model over 258 tokens: high entropy, nothing trivial compared
    # the edges: one row feeding one token, no padding anywhere (sdpa then skips the mask: a single query sees
    # every key); a response of one token (it feeds nothing) beside one of two; all responses of one token
    for rows in ([3], [0, 3], [5, 6, 15]):
        with torch.no_grad():
            a = token_logprobs(lm, make_micro_batch(batch, rows, 0, "cpu"), temperature=0.7)[0]
            b = token_logprobs(lm, make_micro_batch(batch, rows, 0, "cpu", share_prompts=True), temperature=0.7)[0]
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5, rows


@pytest.mark.parametrize(
    "arch,attention,checkpointing",
    [
        ("llama", "eager", False),
        ("llama", "sdpa", False),
        ("qwen2", "eager", False),
        ("qwen2", "sdpa", False),
        ("llama", "sdpa", True),
        ("qwen2", "eager", True),
    ],
)
def test_shared_prompts_give_the_unshared_gradients(arch, attention, checkpointing):
    """The gradient of sum(logp x advantage): every response's part flows back into its prompt's single
    pass. With activation checkpointing both passes run again in backward, reading the same cache."""
    lm = tiny_lm(arch, attention, gradient_checkpointing=checkpointing).train()
    batch = synthetic_batch()
    adv = batch.adv[ROWS]
    lookups = []  # the embedding's backward builds a dense (V, H) gradient per call: one call per micro-batch
    lm.get_input_embeddings().register_forward_hook(lambda *_: lookups.append(1))
    grads = []
    for share, split in ((False, False), (True, True), (True, False)):
        lm.zero_grad(set_to_none=True)
        mb = make_micro_batch(batch, ROWS, 0, "cpu", share_prompts=share, split_responses=split)
        assert not split or len(mb.shared.responses) > 1
        lookups.clear()
        logp, _ = token_logprobs(lm, mb, temperature=0.9, chunk_tokens=64)
        (logp * adv[:, None]).sum().backward()
        assert len(lookups) == 1
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters()})
    unshared, *shared = grads
    scale = max(g.abs().max().item() for g in unshared.values())
    assert scale > 1e-2
    for one in shared:  # response passes split by width, and one response pass
        for name, g in unshared.items():
            assert (one[name] - g).abs().max().item() < 1e-5 * scale, name


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny.build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tiny.save(LlamaForCausalLM(config), tokenizer, path)
    return path


def one_update(model_dir, run_dir, *overrides):
    """The weight change of one SGD update (lr 1) on the synthetic batch, its statistics, and old_logp."""
    cfg = small_config(
        run_dir, model_dir, "train.prompts_per_step=4", "train.mini_batch_prompts=4", "train.grad_clip=1e9", *overrides
    )
    torch.manual_seed(0)
    policy = make_policy(cfg)
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
    batch = synthetic_batch()
    batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
    # move old_logp off the current weights so the ratio is not 1 everywhere and the clip binds somewhere
    batch.old_logp = batch.old_logp + 0.3 * torch.sin(torch.arange(batch.old_logp.numel()).view_as(batch.old_logp))
    batch.old_logp = batch.old_logp * batch.response_mask()
    before = [p.detach().clone() for p in policy.model.parameters()]
    plan = policy.micro_batches(batch, list(range(len(batch))))
    stats = policy.update(batch, loss_fn_of(cfg))
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.model.parameters(), before)])
    return delta, stats, batch, plan


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_one_update_gives_the_unshared_weights(arch, tiny_model_dir, llama_model_dir, tmp_path):
    """One optimizer update (DAPO's loss, a whole mini-batch) with shared prompts: one pass, a budget
    that splits groups (each part still sharing its prompt), and activation checkpointing, all against
    the unshared update in one pass."""
    model_dir = tiny_model_dir if arch == "qwen2" else llama_model_dir
    base, base_stats, base_batch, base_plan = one_update(
        model_dir, tmp_path / "a", "train.max_tokens_per_micro_batch=100000"
    )
    assert len(base_plan) == 1 and base.abs().max() > 1e-3
    for name, overrides in (
        ("one pass", ["train.max_tokens_per_micro_batch=100000"]),
        ("split groups", ["train.max_tokens_per_micro_batch=200"]),
        ("checkpointing", ["train.max_tokens_per_micro_batch=300", "model.gradient_checkpointing=true"]),
    ):
        delta, stats, batch, plan = one_update(model_dir, tmp_path / name, "train.share_prompt_prefix=true", *overrides)
        assert (len(plan) == 1) == (name == "one pass"), (name, plan)
        if name == "split groups":  # the 143-token prompt's rows of 40 and 17 tokens cannot share 200
            assert [rows for rows in plan if set(rows) & {4, 5, 6, 7}] == [[7], [4, 5, 6]]
        assert (batch.entropy - base_batch.entropy).abs().max().item() < 1e-5, name
        assert (delta - base).abs().max().item() < 1e-6, name
        assert stats["grad_norm"].item() == pytest.approx(base_stats["grad_norm"].item(), rel=1e-5), name
        assert stats["pg_loss"].item() == pytest.approx(base_stats["pg_loss"].item(), abs=1e-6), name
        assert stats["clipfrac_high"].item() == pytest.approx(base_stats["clipfrac_high"].item(), abs=1e-6), name
    assert 0 < base_stats["clipfrac_high"].item() + base_stats["clipfrac_low"].item()  # the clip did bind


def test_responses_go_to_passes_of_similar_width():
    # one pass padded to 100 computes 400 tokens; two (100, 96 | 10, 8) compute 200 + 20, plus 64 for the second
    assert response_passes([10, 100, 8, 96]) == [[1, 3], [0, 2]]
    # 100 | 90, 80 would save 20 tokens of padding, less than a pass costs
    assert response_passes([90, 100, 80]) == [[1, 0, 2]]
    assert response_passes([10, 100, 8, 96], split=False) == [[1, 3, 0, 2]]
    assert response_passes([]) == []


def test_the_plan_keeps_prompts_together_within_the_budget():
    # rows 0-2 share prompt 0 (10 tokens), rows 3-5 prompt 1 (4 tokens), rows 6-7 prompt 2 (30 tokens);
    # widths are the tokens each row adds after its prompt
    prompt_of = [0, 0, 0, 1, 1, 1, 2, 2]
    prompt_lengths = [10, 10, 10, 4, 4, 4, 30, 30]
    widths = [4, 4, 2, 3, 1, 3, 5, 5]
    # budget 48: prompt 2 alone costs 30 + 2 x 5 = 40; prompts 0 and 1 together 2 x 10 + 6 x 4 = 44
    assert plan_shared_prompt_micro_batches(prompt_of, prompt_lengths, widths, 48) == [[6, 7], [0, 1, 2, 3, 5, 4]]
    # budget 32: 44 no longer fits, and prompt 2's rows (40 together) are split; 35 each, over the budget alone
    assert plan_shared_prompt_micro_batches(prompt_of, prompt_lengths, widths, 32) == [[6], [7], [0, 1, 2], [3, 5, 4]]
    # at most 2 rows per pass: prompt 0 as rows 0-1 and row 2 (its narrowest), prompt 1 as rows 3 and 5 and row 4;
    # rows 2 and 4, of two prompts, fill one pass (2 x 10 + 2 x 2)
    assert plan_shared_prompt_micro_batches(prompt_of, prompt_lengths, widths, 1000, max_rows=2) == [
        [6, 7],
        [0, 1],
        [3, 5],
        [2, 4],
    ]
    assert plan_shared_prompt_micro_batches([], [], [], 48) == []
    # one prompt of 20 tokens, rows of 60, 5, 5 and 5: in passes of similar width 20 + 60 + 3 x 5 = 95 fits a
    # budget of 100; in one response pass, 20 + 4 x 60 = 260 does not, and the widest row goes alone
    assert plan_shared_prompt_micro_batches([0] * 4, [20] * 4, [60, 5, 5, 5], 100) == [[0, 1, 2, 3]]
    assert plan_shared_prompt_micro_batches([0] * 4, [20] * 4, [60, 5, 5, 5], 100, split_responses=False) == [
        [0],
        [1, 2, 3],
    ]

    rng = random.Random(0)
    for _ in range(100):
        budget = rng.randint(20, 400)
        prompt_of, prompt_lengths, widths = [], [], []
        for u in range(rng.randint(1, 12)):
            p = rng.randint(1, 60)
            for _ in range(rng.randint(1, 8)):
                prompt_of.append(u), prompt_lengths.append(p), widths.append(rng.randint(1, 50))
        max_rows, split = rng.choice([None, 3]), rng.random() < 0.5
        plan = plan_shared_prompt_micro_batches(
            prompt_of, prompt_lengths, widths, budget, max_rows=max_rows, split_responses=split
        )
        assert sorted(i for c in plan for i in c) == list(range(len(prompt_of)))

        def cost(rows):  # prompts once, then the response passes, each padded to its widest
            prompts = {prompt_of[i]: prompt_lengths[i] for i in rows}
            passes = response_passes([widths[i] for i in rows], split=split)
            return len(prompts) * max(prompts.values()) + sum(len(p) * widths[rows[p[0]]] for p in passes)

        for c in plan:
            assert cost(c) <= budget or len(c) == 1
            assert max_rows is None or len(c) <= max_rows
        for u in set(prompt_of):  # a prompt that fits alone is never split
            rows = [i for i in range(len(prompt_of)) if prompt_of[i] == u]
            alone = cost(rows)
            if alone <= budget and (max_rows is None or len(rows) <= max_rows):
                assert sum(1 for c in plan if set(rows) & set(c)) == 1


def test_shared_prompts_cut_the_tokens_computed_on_a_preset_like_batch(tiny_model_dir, tmp_path):
    """The real-model preset's shape: 4 prompts of 61-75 tokens x G = 8, responses of 25-96 tokens,
    a 4,096-token budget. Counted at the decoder's input, in the old-log-prob pass and the update."""
    rng = random.Random(0)
    prompt_lengths = (61, 66, 70, 75)
    response_lengths = [[rng.randint(25, 96) for _ in range(8)] for _ in prompt_lengths]
    batch = synthetic_batch(prompt_lengths, response_lengths)
    counts = {}
    for share in ("false", "true"):
        cfg = small_config(
            tmp_path / share,
            tiny_model_dir,
            "train.prompts_per_step=4",
            "train.mini_batch_prompts=4",
            "train.max_tokens_per_micro_batch=4096",
            f"train.share_prompt_prefix={share}",
        )
        policy = make_policy(cfg)
        fed = []
        hook = policy.model.get_decoder().embed_tokens.register_forward_hook(
            lambda m, args, out: fed.append(args[0].numel())
        )
        batch.old_logp, _ = policy.compute_logprobs(batch)
        logprob_tokens = sum(fed)
        policy.update(batch, loss_fn_of(cfg))
        hook.remove()
        plan = policy.micro_batches(batch, list(range(len(batch))))
        planned = sum(policy._make_micro_batch(batch, rows).num_tokens for rows in plan)
        assert logprob_tokens == sum(fed) - logprob_tokens == planned  # the update runs the same passes
        counts[share] = (logprob_tokens, len(plan))
    (unshared, unshared_passes), (shared, shared_passes) = counts["false"], counts["true"]
    responses = sum(map(sum, response_lengths))
    print(
        f"\ntokens per pass over the batch: {unshared} unshared in {unshared_passes} micro-batches, {shared} shared "
        f"in {shared_passes} ({unshared / shared:.2f}x fewer); {responses} response tokens"
    )
    assert unshared / shared > 1.5


def test_what_cannot_share_a_prompt_is_refused_in_one_line(tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    with pytest.raises(ConfigError) as err:  # packed rows have no padded rows to share a prompt across
        small_config(tmp_path, tiny_model_dir, "train.share_prompt_prefix=true", "train.pack_sequences=true")
    assert str(err.value).startswith("train.share_prompt_prefix=true") and "train.pack_sequences" in str(err.value)
    assert "\n" not in str(err.value)

    # a sliding window shorter than the run's sequences is not full attention over them
    tokenizer = tiny.build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=32,
        max_window_layers=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tiny.save(Qwen2ForCausalLM(config), tokenizer, tmp_path / "sliding")
    cfg = small_config(tmp_path, tmp_path / "sliding", "train.share_prompt_prefix=true")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    with pytest.raises(ConfigError) as err:
        make_policy(cfg)
    assert str(err.value) == (
        f"train.share_prompt_prefix=true: {tmp_path / 'sliding'} has sliding-window attention "
        f"over 32 tokens, shorter than the longest sequence (data.max_prompt_tokens + "
        f"rollout.max_response_tokens = {longest}); set train.share_prompt_prefix=false"
    )
    make_policy(small_config(tmp_path, tmp_path / "sliding"))  # unshared, the same model trains

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert unsupported(flash) == "attention implementation 'flash_attention_2' (supported: eager, sdpa)"
    assert unsupported(tiny_lm("llama", "eager")) is None and unsupported(tiny_lm("qwen2", "sdpa")) is None
    assert (
        unsupported(tiny_lm("qwen2", "sdpa", gradient_checkpointing=True)) is None
    )  # transformers' default: non-reentrant
    reentrant = tiny_lm("llama", "sdpa")
    reentrant.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert unsupported(reentrant) == (
        "reentrant activation checkpointing (the cached prompt would get no gradient; use use_reentrant=False)"
    )


def test_the_reference_model_shares_prompts_too(tiny_model_dir, tmp_path):
    from dapo.model.policy import ReferenceModel

    batch = synthetic_batch()
    logp = {}
    for share in ("false", "true"):
        cfg = small_config(tmp_path, tiny_model_dir, f"train.share_prompt_prefix={share}")
        ref = ReferenceModel(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
        logp[share] = ref.logprobs(batch)
    assert (logp["true"] - logp["false"]).abs().max().item() < 1e-5
    assert (logp["true"] * batch.response_mask() == logp["true"]).all() and logp["true"].min() < -1


def test_training_with_shared_prompts_logs_the_unshared_runs_metrics(tiny_model_dir, tmp_path):
    """Two steps of the loop, with a KL term (the reference model's pass too): the same samples, the
    same losses, gradient norms and entropies, and the same weights at the end."""
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    runs = {}
    for share in ("false", "true"):
        cfg = small_config(tmp_path / share, tiny_model_dir, "algo.kl_coef=0.01", f"train.share_prompt_prefix={share}")
        train(cfg)
        model, _ = load_model_and_tokenizer(cfg.run_dir / "checkpoints" / "step_000002" / "model")
        runs[share] = read_metrics(cfg.run_dir), dict(model.named_parameters())
    (unshared, w0), (shared, w1) = runs["false"], runs["true"]
    assert [r["step"] for r in shared] == [1, 2]
    for a, b in zip(unshared, shared):
        assert a["rollout/response_length_mean"] == b["rollout/response_length_mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    assert max((w1[k] - w0[k]).abs().max().item() for k in w0) < 1e-5
    assert unshared[-1]["actor/kl_loss"] > 0
