"""Generation on the demo, ours against TRL's, counted and profiled: where a rollout's time goes.

    python benchmarks/generation_profile.py [--prompts 32] [--G 8] [--max-new 48] [--seed 0] [--threads 1]
    python benchmarks/generation_profile.py --model ~/.cache/dapo/models/SmolLM2-135M-Instruct --prompts 4 --G 4 \
        --max-new 96 --temperature 0.7 --sides ours,ours-generate

Both sides generate for the same prompt token ids (the problems both sides of benchmarks/vs_trl.py train on), the
same G, length limit, temperature and seed:

- ours: dapo's HFRolloutEngine on the policy's model as the demo's run builds it (dapo.model.policy.Policy
  with configs/demo.yaml's model and train sections);
- ours-generate: the same engine with transformers ``generate`` (every row decoded until its chunk's longest ends);
- trl: ``model.generate`` as TRL's GRPOTrainer calls it without vLLM (one left-padded batch of every row, its
  GenerationConfig: do_sample, temperature, top_p, top_k, min_p, repetition_penalty, disable_compile), on a model
  loaded as benchmarks/vs_trl_workers.py loads TRL's.

Printed per side: CPU seconds (process time, one torch thread unless --threads), the model's forward calls, decode
slots (rows in each forward after the prefill, summed) per generated token, padded positions of the prefill, and
cProfile's cumulative seconds for the components of generate (the model's forward, logits processors, stopping
criteria, the rest). Counts are exact; seconds on a shared machine are not, so proportions are what to read.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# cProfile entries summed into each component (matched on "file:function" of the profile's rows)
COMPONENTS = {
    "model forward": ("modeling_qwen2.py:forward", "modeling_llama.py:forward"),
    "logits processors": ("logits_process.py:__call__",),
    "stopping criteria": ("stopping_criteria.py:__call__",),
    "sampling (multinomial)": ("<built-in method torch.multinomial>",),
    "cache update": ("cache_utils.py:update",),
    "prepare inputs for generation": ("utils.py:prepare_inputs_for_generation",),
    "rollout engine outside generate": ("hf.py:_left_pad", "hf.py:_logprobs", "base.py:split_response"),
    "decode texts": ("tokenization_utils_base.py:batch_decode",),
}


class ForwardCounter:
    """Counts the model's forward calls and the rows and positions each computes (a pre-hook: counting only)."""

    def __init__(self, model):
        self.calls, self.prefill_positions, self.decode_slots = 0, 0, 0
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, width = ids.shape
        self.calls += 1
        if width > 1:
            self.prefill_positions += rows * width
        else:
            self.decode_slots += rows

    def close(self):
        self.handle.remove()


def prompts_for(tokenizer, n: int, model_path: Path) -> list[list[int]]:
    """The first ``n`` training problems each side of benchmarks/vs_trl.py trains on: the demo's arith problems as
    plain text, or for a real model the word problems as user turns of its chat template."""
    from dapo.data import arith
    from dapo.data.files import load_examples
    from dapo.data.prompts import Example, Message, make_encoder

    if "arith" in str(model_path):
        examples = arith.make_examples("train", n, seed=0, difficulty="demo")
    else:
        raw = load_examples(ROOT / "data/word_problems/train.jsonl", template="raw")[:n]
        examples = [Example(e.uid, (Message("user", e.text()),), e.ground_truth, e.data_source) for e in raw]
    return [make_encoder(tokenizer, 512)(e) for e in examples]


def our_side(model_path: Path, args, *, compacting: bool = True):
    """The policy as the demo's run loads it, and the engine the run samples with (``compacting=False``: with
    transformers ``generate``, every row of a chunk decoded until its longest ends)."""
    from dapo.config import load_config
    from dapo.model.policy import Policy
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine

    cfg = load_config(ROOT / "configs/demo.yaml", [f"model.path={model_path}", "model.device=cpu"])
    policy = Policy(cfg.model, cfg.train, temperature=args.temperature, device=torch.device("cpu"))
    engine = HFRolloutEngine(policy.model, policy.tokenizer, compacting=compacting)
    sampling = SamplingParams(
        n=args.G, temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new, seed=args.seed
    )

    def generate(prompts):
        gen = engine.generate(prompts, sampling)
        return [len(r) for r in gen.response_ids]

    return policy.model, policy.tokenizer, generate


def trl_side(model_path: Path, args):
    """The model as TRL's side loads it, and generate as GRPOTrainer calls it (trl/trainer/grpo_trainer.py,
    _generate_single_turn without vLLM): every row in one left-padded batch, the model in training mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    config = GenerationConfig(
        max_new_tokens=args.max_new, do_sample=True, pad_token_id=pad, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos, temperature=args.temperature, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        cache_implementation=None, disable_compile=True,
    )  # fmt: skip

    def generate(prompts):
        rows = [p for p in prompts for _ in range(args.G)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        torch.manual_seed(args.seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        lengths = []
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            lengths.append(ends[0] + 1 if ends else len(row))
        return lengths

    return model, tokenizer, generate


def components(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds of each component: its costliest entry's (the outermost of nested calls, as the model's
    forward holds its layers' forwards and a processor list its processors)."""
    stats = pstats.Stats(profile).stats
    out = {}
    for name, keys in COMPONENTS.items():
        out[name] = max(
            (
                cumtime
                for (path, _, func), (_, _, _, cumtime, _) in stats.items()
                if any(f"{Path(path).name}:{func}" == k or func == k for k in keys)
            ),
            default=0.0,
        )
    return out


def measure(side: str, args) -> dict:
    model_path = Path(args.model).expanduser()
    build = {"ours": our_side, "ours-generate": partial(our_side, compacting=False), "trl": trl_side}[side]
    model, tokenizer, generate = build(model_path, args)
    prompts = prompts_for(tokenizer, args.prompts, model_path)
    generate(prompts[: max(1, len(prompts) // 8)])  # warm-up: first-call costs are not generation's
    counter = ForwardCounter(model)
    profile = cProfile.Profile()
    c0, t0 = time.process_time(), time.perf_counter()
    profile.enable()
    lengths = generate(prompts)
    profile.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    counter.close()
    generated = sum(lengths)
    total = pstats.Stats(profile).total_tt
    widths = [len(p) for p in prompts]
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "forward_calls": counter.calls,
        "generated_tokens": generated,
        "longest": max(lengths),
        "decode_slots": counter.decode_slots,
        "slots_per_token": counter.decode_slots / max(1, generated),
        "prefill_positions": counter.prefill_positions,
        "prompt_tokens": sum(widths) * args.G,
        "profile_s": total,
        "components": components(profile),
        "profile": profile,
    }


def report(side: str, r: dict, top: int) -> None:
    print(f"\n== {side}: {r['cpu_s']:.2f} CPU s, {r['wall_s']:.2f} s wall (profiled; timings under load)")
    print(
        f"  forward calls {r['forward_calls']}, generated tokens {r['generated_tokens']} (longest {r['longest']}), "
        f"decode slots {r['decode_slots']} = {r['slots_per_token']:.2f} per generated token"
    )
    pad = r["prefill_positions"] - r["prompt_tokens"]
    print(f"  prefill positions {r['prefill_positions']} ({pad} padding, {pad / r['prefill_positions']:.1%})")
    for name, s in r["components"].items():
        print(f"  {name:32s} {s:6.2f} s  {s / r['profile_s']:6.1%}")
    if top:
        pstats.Stats(r["profile"]).sort_stats("tottime").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "assets/arith-base"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sides", default="ours,trl", help="comma-separated: ours, ours-generate, trl")
    p.add_argument("--top", type=int, default=0, help="also print the profile's N costliest functions (own time)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {side: measure(side, args) for side in args.sides.split(",")}
    for side, r in results.items():
        report(side, r, args.top)
    if {"ours", "trl"} <= set(results):
        o, t = results["ours"], results["trl"]
        per_token = (o["cpu_s"] / o["generated_tokens"]) / (t["cpu_s"] / t["generated_tokens"])
        print(f"\nours / trl: CPU s {o['cpu_s'] / t['cpu_s']:.2f}x, CPU s per generated token {per_token:.2f}x")


if __name__ == "__main__":
    main()
