"""The --real mode of benchmarks/mfu.py: SmolLM2-135M-Instruct at its preset (configs/smollm2_135m.yaml) on a
synthetic rollout batch of the preset's shape; old log-probs and update timed separately, wall and CPU time,
against torch.mm at the matmul shapes each pass runs; ends with ``update MFU: NN%``. The training phases and the
torch.mm reference are measured for load (benchmarks/runs.py's Meter, the torch threads its own jobs): where either
saw more, no share of torch.mm is printed, and the last line says why instead."""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import make_loss_fn
from dapo.config import load_config
from dapo.data.files import load_examples
from dapo.data.prompts import make_encoder
from dapo.model.logprobs import head_chunk_rows
from dapo.model.policy import Policy
from mfu_matmul import mm_rate, model_shapes, shapes_rate
from runs import Meter, withheld

ROOT = Path(__file__).resolve().parents[1]
REAL_CONFIG = ROOT / "configs/smollm2_135m.yaml"
CATEGORIES = (  # profile rows by op name, first match wins
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("softmax / logsumexp", ("softmax", "logsumexp")),
    ("embedding", ("embedding",)),
    ("copies / layout", ("copy_", "contiguous", "clone", "cat", "index", "gather", "scatter", "fill_", "zero_")),
)


def synthetic_batch(policy: Policy, cfg, seed: int = 0) -> RolloutBatch:
    """A rollout batch of the preset's shape without sampling: fast and the same every run.

    Prompts: ``prompts_per_step`` word problems from the training file, rendered with the model's
    chat template exactly as training encodes them. Responses: G per prompt, lengths drawn uniformly
    from 25 to the response limit, one in eight cut at the limit (truncated, no EOS); their tokens
    are runs of the problems' own text (real tokens of this tokenizer), ending in EOS. Rewards
    alternate right/wrong within each group, so every row carries an advantage.
    """
    r, tok = cfg.rollout, policy.tokenizer
    rng = random.Random(seed)
    examples = load_examples(ROOT / cfg.data.train_files[0], template=cfg.data.template)
    chosen = rng.sample(examples, cfg.train.prompts_per_step)
    encode = make_encoder(tok, cfg.data.max_prompt_tokens)
    stream = tok("\n".join(ex.text() for ex in examples[:300]), add_special_tokens=False)["input_ids"]
    limit = r.max_response_tokens
    prompt_ids, response_ids, truncated = [], [], []
    for ex in chosen:
        for _ in range(r.group_size):
            cut = rng.random() < 1 / 8
            n = limit if cut else rng.randint(25, limit)
            start = rng.randrange(len(stream) - n)
            ids = stream[start : start + n]
            if not cut:
                ids = ids[:-1] + [tok.eos_token_id]
            prompt_ids.append(encode(ex))
            response_ids.append(ids)
            truncated.append(cut)
    rows = [ex for ex in chosen for _ in range(r.group_size)]
    acc = torch.tensor([float(j % 2) for j in range(len(rows))])
    texts = [tok.decode(x) for x in response_ids]
    return graded_batch(rows, r.group_size, prompt_ids, response_ids, torch.tensor(truncated), texts, acc)


def graded_batch(rows, group_size: int, prompt_ids, response_ids, truncated, texts, acc) -> RolloutBatch:
    """A rollout batch of ``rows`` (an example per response) with accuracies ``acc``: the +1/-1 rule's reward, no
    overlong penalty, group-normalised advantages, as the loop would grade it."""
    batch = RolloutBatch.of_responses(
        prompt_ids,
        response_ids,
        group_size=group_size,
        truncated=truncated,
        texts=texts,
        example_uids=[ex.uid for ex in rows],
        ground_truths=[ex.ground_truth for ex in rows],
        reward=acc * 2 - 1,
    )
    batch.adv = advantages.group_advantages(batch.reward, group_size)
    return batch


def sub_batch(batch: RolloutBatch, groups: int) -> RolloutBatch:
    """The first ``groups`` groups of ``batch`` (a warm-up pass)."""
    return batch.select_groups(list(range(groups)))


def decoder_calls(mb) -> list[tuple[int, int, int]]:
    """(rows, query length, cached length) of each decoder call of a micro-batch: one call, or with
    shared prompts the prompt pass and the response passes after it."""
    if mb.shared is None:
        return [tuple(mb.input_ids.shape) + (0,)]
    prompts = tuple(mb.shared.input_ids.shape)
    return [prompts + (0,)] + [tuple(part.input_ids.shape) + (prompts[1],) for part in mb.shared.responses]


def pass_shapes(policy: Policy, batch: RolloutBatch, rows_per_pass: list[list[int]], chunk: int):
    """The model's matmuls over these micro-batches as (m, k, n, count) at their mean row counts per
    decoder call, and the FLOPs they execute: decoder weights at padded tokens, the LM head at response
    tokens (in ``chunk``-row pieces), causal attention (QK^T and PV: half of L^2 per row, plus L x the
    cached length after a shared prompt)."""
    c = policy.model.config
    mbs = [policy._make_micro_batch(batch, rows) for rows in rows_per_pass]
    calls = [call for mb in mbs for call in decoder_calls(mb)]
    m_dec = round(statistics.mean(rows * length for rows, length, _ in calls))
    resp = [mb.targets.numel() for mb in mbs]
    m_head = round(statistics.mean(min(chunk, n) for n in resp))
    layer = model_shapes(c)[:7]
    shapes = [(m_dec, k, n, c.num_hidden_layers) for k, n in layer] + [(m_head, c.hidden_size, c.vocab_size, 1)]
    decoder_flops = sum(2 * mb.num_tokens * k * n for mb in mbs for k, n in layer) * c.num_hidden_layers
    head_flops = 2 * sum(resp) * c.hidden_size * c.vocab_size
    attn_flops = (
        sum(2 * rows * (length**2 + 2 * length * cached) * c.hidden_size for rows, length, cached in calls)
        * c.num_hidden_layers
    )
    return shapes, decoder_flops, head_flops, attn_flops, m_dec, m_head


def computed_tokens(policy: Policy, batch: RolloutBatch, rows_per_pass: list[list[int]]) -> int:
    """Real tokens through the decoder over these micro-batches: prompt + response per row, or with a
    shared prompt prefix each distinct prompt of a micro-batch once plus its rows' responses."""
    total = 0
    for rows in rows_per_pass:
        total += sum(len(batch.response_ids[i]) for i in rows)
        prompts = [tuple(batch.prompt_ids[i]) for i in rows]
        total += sum(map(len, set(prompts) if policy.share_prompts else prompts))
    return total


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def profile_table(policy: Policy, batch: RolloutBatch, loss_fn) -> list[str]:
    """One update under torch.profiler: the main thread's op self time by category, and what lies
    outside aten ops (Python, autograd engine, the loop) as wall time minus the ops' self time."""
    from torch.profiler import ProfilerActivity, profile

    w0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        policy.update(batch, loss_fn)
    wall = (time.perf_counter() - w0) * 1e6
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.key.startswith("aten::")]
    by_cat: dict[str, float] = {}
    for e in prof.events():  # each op once, with its callers: AdamW's per-tensor ops sit under Optimizer.step
        if e.self_cpu_time_total <= 0 or not e.name.startswith("aten::"):
            continue
        parent, in_step = e.cpu_parent, False
        while parent is not None and not in_step:
            in_step, parent = parent.name.startswith("Optimizer.step"), parent.cpu_parent
        cat = (
            "optimizer (AdamW step)"
            if in_step
            else next((name for name, keys in CATEGORIES if any(k in e.name for k in keys)), "elementwise / other aten")
        )
        by_cat[cat] = by_cat.get(cat, 0.0) + e.self_cpu_time_total
    ops = sum(by_cat.values())
    by_cat["outside aten ops (Python, autograd, profiler)"] = max(0.0, wall - ops)
    lines = [f"profile of one update ({wall / 1e6:.1f} s wall under the profiler), main-thread self time by kind:"]
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:48s} {us / 1e6:8.2f} s  {us / wall:5.1%}")
    lines.append("  top ops:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
        lines.append(
            f"    {e.key:46s} {e.self_cpu_time_total / 1e6:8.2f} s  {e.self_cpu_time_total / wall:5.1%}  x{e.count}"
        )
    return lines


def real_passes(policy: Policy, cfg, batch: RolloutBatch, head_chunk: int | None) -> SimpleNamespace:
    """The old-log-prob pass and the update over ``batch``: their micro-batches, the real tokens each
    computes, the matmul shapes torch.mm is timed at, and the FLOPs their matmuls execute."""
    c = policy.model.config
    rows = list(range(len(batch)))
    old_mbs = policy.micro_batches(batch, rows)
    per_update = cfg.train.mini_batch_prompts * batch.group_size
    upd_mbs = [
        mb for s in range(0, len(batch), per_update) for mb in policy.micro_batches(batch, rows[s : s + per_update])
    ]
    # the tokens the model must see: with a shared prompt prefix a prompt counts once per micro-batch it
    # is in, not once per response (counting it per row would credit the update with work it skips)
    old_tokens, upd_tokens = computed_tokens(policy, batch, old_mbs), computed_tokens(policy, batch, upd_mbs)
    chunk = head_chunk or head_chunk_rows(c.vocab_size, torch.device("cpu"))  # the head's matmul rows, as trained
    old_shapes, old_dec, old_head, old_attn, old_m, old_mh = pass_shapes(policy, batch, old_mbs, chunk)
    upd_shapes, upd_dec, upd_head, upd_attn, upd_m, upd_mh = pass_shapes(policy, batch, upd_mbs, chunk)
    epochs = cfg.train.ppo_epochs
    return SimpleNamespace(
        old_mbs=old_mbs,
        upd_mbs=upd_mbs,
        old_tokens=old_tokens,
        upd_tokens=upd_tokens,
        old_shapes=old_shapes,
        upd_shapes=upd_shapes,
        old_m=old_m,
        old_mh=old_mh,
        upd_m=upd_m,
        upd_mh=upd_mh,
        epochs=epochs,
        # executed matmul FLOPs: forward 2x, backward 4x; the LM head's chunks are checkpointed (forward twice)
        upd_exec=epochs * (3 * upd_dec + 4 * upd_head + 3 * upd_attn),
        old_exec=old_dec + old_head + old_attn,
    )


def time_real_phases(updates: int, policy: Policy, batch: RolloutBatch, loss_fn, p: SimpleNamespace):
    """``updates`` training phases, each after timing torch.mm at both passes' shapes: the medians of old
    log-probs and update (wall and CPU) and of the two torch.mm references, and the meters ("train", "mm") that
    measured them."""
    t_old, t_upd, ref_old, ref_upd = [], [], [], []
    meters = {"train": Meter(torch.get_num_threads()), "mm": Meter(torch.get_num_threads())}
    for _ in range(updates):
        with meters["mm"]:
            ref_old.append(shapes_rate(p.old_shapes))
            ref_upd.append(shapes_rate(p.upd_shapes))
        with meters["train"]:
            a = clock()
            batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
            b = clock()
            policy.update(batch, loss_fn)
            e = clock()
        t_old.append((b[0] - a[0], b[1] - a[1]))
        t_upd.append((e[0] - b[0], e[1] - b[1]))
        print(
            f"  iteration: old log-probs {t_old[-1][0]:.1f} s wall / {t_old[-1][1]:.1f} s CPU, update "
            f"{t_upd[-1][0]:.1f} s wall / {t_upd[-1][1]:.1f} s CPU",
            flush=True,
        )
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return SimpleNamespace(
        old_w=med(t_old, 0),
        old_c=med(t_old, 1),
        upd_w=med(t_upd, 0),
        upd_c=med(t_upd, 1),
        mm_old=statistics.median(ref_old),
        mm_upd=statistics.median(ref_upd),
        meters=meters,
    )


def mfu_withheld(t: SimpleNamespace) -> str | None:
    """Why the shares of torch.mm are no figure (the phases or the reference saw more load than their own jobs)."""
    return withheld([m.load.summary() for m in t.meters.values()], "MFU", unit="measurements")


def print_real_setup(args, cfg, policy: Policy, batch: RolloutBatch, n_params: int, p: SimpleNamespace) -> None:
    """What was measured: versions and threads, the model, the batch, the tokens counted, the micro-batches."""
    c = policy.model.config
    prompt_tok = sum(map(len, batch.prompt_ids))
    resp_tok = sum(map(len, batch.response_ids))
    row_tokens = prompt_tok + resp_tok
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {threads} threads (interop {torch.get_num_interop_threads()}), load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; times are medians of {args.updates}"
    )
    print(
        f"model SmolLM2-135M-Instruct, {n_params:,} parameters (hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
        f"vocab {c.vocab_size}), {cfg.model.dtype}"
    )
    print(
        f"batch {len(batch)} responses: {row_tokens:,} tokens ({prompt_tok:,} prompt, {resp_tok:,} response; prompts "
        f"{min(map(len, batch.prompt_ids))}-{max(map(len, batch.prompt_ids))}, responses "
        f"{min(map(len, batch.response_ids))}-{max(map(len, batch.response_ids))}); token budget "
        f"{cfg.train.max_tokens_per_micro_batch}, packed {policy.packed}, prompts shared {policy.share_prompts}"
    )
    print(
        f"tokens counted below (real, without padding; a shared prompt once per micro-batch): old log-probs "
        f"{p.old_tokens:,}, update {p.upd_tokens:,} per epoch"
    )
    print(
        f"micro-batches: old log-probs {len(p.old_mbs)} (~{p.old_m} tokens incl. padding per decoder "
        f"call, head {p.old_mh} rows), "
        f"update {len(p.upd_mbs)} x {p.epochs} epoch(s) (~{p.upd_m} tokens, head {p.upd_mh} rows)"
    )


def print_real_rates(batch: RolloutBatch, n_params: int, p: SimpleNamespace, t: SimpleNamespace, square: float):
    """Each pass's throughput and FLOP rate against torch.mm at its shapes, then the whole phase's."""
    row_tokens = sum(map(len, batch.prompt_ids)) + sum(map(len, batch.response_ids))
    epochs = p.epochs
    upd_6n = 6 * n_params * p.upd_tokens * epochs
    old_2n = 2 * n_params * p.old_tokens
    reason = mfu_withheld(t)

    def share(x: float) -> str:
        return "-" if reason else f"{x:5.1%}"

    print("CPU-time rates (the process's CPU seconds over all threads; torch.mm measured the same way):")
    for name, flops, exec_flops, w, cpu, mm, n_tok in (
        ("old log-probs (2N/token)", old_2n, p.old_exec, t.old_w, t.old_c, t.mm_old, p.old_tokens),
        ("update (6N/token)", upd_6n, p.upd_exec, t.upd_w, t.upd_c, t.mm_upd, p.upd_tokens * epochs),
    ):
        print(
            f"  {name:26s} {w:7.1f} s wall {cpu:7.1f} s CPU  {n_tok / w:7.0f} tok/s wall"
            f" ({row_tokens * (1 if 'old' in name else epochs) / w:.0f} of the rows' prompt + response)"
            f"  {flops / cpu / 1e9:6.1f} GFLOP/s per CPU s ({flops / w / 1e9:6.1f} per wall s)"
            f"  torch.mm {mm / 1e9:6.1f}  -> {share(flops / cpu / mm)}; executed matmul FLOPs "
            f"{exec_flops / flops:.2f}x of "
            f"that -> {share(exec_flops / cpu / mm)}"
        )
    print(f"torch.mm 1024x1024x1024: {square / 1e9:.1f} GFLOP/s per CPU s")
    for name, m in t.meters.items():
        print(f"{name:5s} timed: {m.cpu_s:.1f} CPU s, {m.wall_s:.1f} wall s ({m.load.describe()})")
    print(
        "training phase (old log-probs + update, 8N/token): "
        f"{share((old_2n + upd_6n) / (t.old_c + t.upd_c) / t.mm_upd).strip()} of torch.mm"
    )


def real_main(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(str(REAL_CONFIG), ["model.device=cpu", *args.overrides])
    policy = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    loss_fn = make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)
    batch = synthetic_batch(policy, cfg)
    n_params = sum(p.numel() for p in policy.model.parameters())
    passes = real_passes(policy, cfg, batch, args.head_chunk)

    warm = sub_batch(batch, 2)  # first-call allocations and the optimizer state, on a small batch
    warm.old_logp, warm.entropy = policy.compute_logprobs(warm, with_entropy=True)
    policy.update(warm, loss_fn)

    times = time_real_phases(args.updates, policy, batch, loss_fn, passes)
    with times.meters["mm"]:
        square = mm_rate(1024, 1024, 1024)
    print_real_setup(args, cfg, policy, batch, n_params, passes)
    print_real_rates(batch, n_params, passes, times, square)
    for line in profile_table(policy, batch, loss_fn):
        print(line)
    upd_6n = 6 * n_params * passes.upd_tokens * passes.epochs
    print(f"update MFU: {mfu_withheld(times) or f'{upd_6n / times.upd_c / times.mm_upd:.0%}'}")
