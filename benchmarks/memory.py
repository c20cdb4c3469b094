"""Peak memory of the training phase (old log-probs + one update) against batch size and response length.

    python benchmarks/memory.py [--budget 2048] [--vocab 16384] [--threads 1]

What runs out of memory in RL training is the [batch x length x vocab] logits, not the weights,
so the model here is a small Qwen2 (hidden 128, 2 layers) with a real-sized vocabulary (16k by
default), built locally with random weights. Each point runs in a fresh process: policy and
batch are built, the peak RSS is reset (/proc/self/clear_refs), then the loop's training phase
runs once: old log-probs with entropy, then Policy.update (one optimizer update over the whole
batch). Printed: peak RSS minus RSS before the phase (on a GPU: peak allocated minus allocated).
Responses are random tokens of exactly the given length; prompts are arith problems. glibc is told
to serve blocks over 64 KiB with mmap, so freed tensors leave the RSS at once and the peak follows
the live tensors rather than the heap's fragmentation.

Micro-batches follow a token budget: train.max_tokens_per_micro_batch=--budget where the config
has that field; otherwise train.micro_batch_size=--budget // (prompt + --length tokens), the row
count that fits the budget at the batch sweep's length, which is all a fixed row count can do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = [16, 32, 64, 128]  # responses (G=8 per prompt), at --length tokens
LENGTHS = [128, 256, 512, 1024]  # response tokens, at --batch responses
PROMPT_TOKENS = 7  # an arith prompt ("6+5*3=\n")


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def has_token_budget() -> bool:
    from dapo.config import TrainConfig

    return "max_tokens_per_micro_batch" in TrainConfig.__dataclass_fields__


def micro_batching(args) -> str:
    if has_token_budget():
        return f"train.max_tokens_per_micro_batch={args.budget}"
    return f"train.micro_batch_size={max(1, args.budget // (PROMPT_TOKENS + args.length))}"


def build_model(path: str, vocab: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def training_setup(args, group: int):
    """The policy and loss of the measured point: --batch responses of --length tokens, one update."""
    import torch

    from dapo.algorithm.step import make_loss_fn
    from dapo.config import load_config
    from dapo.model.policy import Policy

    B, L = args.batch, args.length
    cfg = load_config(
        None,
        [
            f"model.path={args.model}",
            f"model.device={'cuda' if torch.cuda.is_available() else 'cpu'}",
            f"rollout.group_size={group}",
            f"rollout.max_response_tokens={L}",
            "algo.soft_overlong_punishment=false",
            f"train.prompts_per_step={B // group}",
            f"train.mini_batch_prompts={B // group}",
            args.micro_batching,
        ],
    )
    policy = Policy(
        cfg.model,
        cfg.train,
        temperature=cfg.rollout.temperature,
        device=torch.device(cfg.model.device if cfg.model.device != "auto" else "cpu"),
    )
    return policy, make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)


def random_batch(encode, gen, group: int, n: int, length: int):
    """``n`` responses of ``length`` random tokens after arith prompts, rewards +1/-1 at random."""
    import torch

    from dapo.algorithm import advantages
    from dapo.algorithm.batch import RolloutBatch
    from dapo.data import arith

    rows = [ex for ex in arith.make_examples("train", n // group, seed=0) for _ in range(group)]
    reward = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    batch = RolloutBatch.of_responses(
        [encode(ex) for ex in rows],
        torch.randint(2, 258, (n, length), generator=gen).tolist(),
        group_size=group,
        example_uids=[ex.uid for ex in rows],
        ground_truths=[ex.ground_truth for ex in rows],
        reward=reward,
    )
    batch.adv = advantages.group_advantages(batch.reward, group)
    return batch


def point(args) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    from dapo.data.prompts import make_encoder

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    G, B, L = 8, args.batch, args.length
    policy, loss_fn = training_setup(args, G)
    encode = make_encoder(policy.tokenizer, 64)
    gen = torch.Generator().manual_seed(0)

    def training_phase(batch) -> None:
        batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
        policy.update(batch, loss_fn)

    # a small pass first: library buffers, kernels and optimizer state are set up once per process
    training_phase(random_batch(encode, gen, G, G, 16))
    batch = random_batch(encode, gen, G, B, L)
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    rss_before = status_kb("VmRSS")
    t0 = time.perf_counter()
    training_phase(batch)
    seconds = time.perf_counter() - t0
    out = {
        "rss_peak_mb": (status_kb("VmHWM") - rss_before) / 1024,
        "rss_total_mb": status_kb("VmHWM") / 1024,
        "seconds": seconds,
    }
    if cuda:
        out["gpu_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return out


def launch(args, model: str, batch: int, length: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        __file__,
        "--point",
        out,
        "--model",
        model,
        "--batch",
        str(batch),
        "--length",
        str(length),
        "--threads",
        str(args.threads),
        "--micro-batching",
        micro_batching(args),
    ]
    # large blocks straight from and back to the OS, so RSS follows the live tensors, not the heap's history
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def show(label: str, value: int, res: dict) -> None:
    if "error" in res:
        print(f"  {label} {value:6d}  failed: {res['error']}", flush=True)
        return
    gpu = f"  GPU peak {res['gpu_peak_mb']:8.0f} MB" if "gpu_peak_mb" in res else ""
    print(
        f"  {label} {value:6d}  peak RSS +{res['rss_peak_mb']:7.0f} MB (process {res['rss_total_mb']:6.0f} MB)"
        f"{gpu}  {res['seconds']:6.1f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=16, help="responses, for the length sweep")
    parser.add_argument("--length", type=int, default=128, help="response tokens, for the batch sweep")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--point", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batching", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        Path(args.point).write_text(json.dumps(point(args)))
        return
    with tempfile.TemporaryDirectory() as model:
        build_model(model, args.vocab)
        mode = micro_batching(args)
        print(
            f"model: hidden 128, 2 layers, vocab {args.vocab}; micro-batching: {mode}; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        print(f"batch sweep, {args.length} response tokens:")
        for b in BATCHES:
            show("batch", b, launch(args, model, b, args.length))
        print(f"length sweep, {args.batch} responses:")
        for n in LENGTHS:
            show("length", n, launch(args, model, args.batch, n))


if __name__ == "__main__":
    main()
