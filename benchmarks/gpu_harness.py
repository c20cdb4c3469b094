"""The harness of benchmarks/gpu.py: randomly initialised models of real shapes built on the device, a Policy
handed such a model, random rollout batches, timing with the device synchronised (wall seconds, and the CPU seconds
and the machine's load over the same calls: benchmarks/runs.py's Meter), and the table's rows."""

from __future__ import annotations

import contextlib
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import Meter, withheld  # noqa: E402

SHAPES = {  # the configs of the published models (config.json), built with random weights
    "qwen2.5-0.5b": dict(arch="qwen2", hidden=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tied=True),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tied=True),
    "qwen2.5-7b": dict(arch="qwen2", hidden=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tied=False),
    "smollm2-135m": dict(arch="llama", hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152, tied=True),
}
SMOKE_SHAPE = dict(hidden=64, inter=128, layers=2, heads=4, kv=2, vocab=1024)


class Harness:
    """What every part of benchmarks/gpu.py measures with; the parts are Bench's methods there."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        self.peak_flops: float | None = None
        self.results: dict[str, dict] = {}
        self.rows: dict[str, list[str]] = {}  # the table's rows, by the part that measured them
        self.part = ""  # the part running
        self.on_row = None  # called after each row is recorded (main: write the JSON so far)
        self.peak_load: dict | None = None  # the load the MFU reference was measured under (Load.summary())
        self.last: Meter | None = None  # the meter of the latest timed call

    def meter(self) -> Meter:
        """A Meter for a measurement's calls; its own jobs: the one thread that drives the GPU (on the CPU, torch's
        threads)."""
        return Meter(own_jobs=1 if self.cuda else torch.get_num_threads())

    def withheld(self, *loads: dict | None, what: str = "MFU") -> str | None:
        """Why a ratio of times over measurements that saw ``loads`` is no figure (benchmarks/runs.py), or None."""
        return withheld(list(loads), what, unit="measurements")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def shape(self, name: str) -> dict:
        return {**SHAPES[name], **SMOKE_SHAPE} if self.smoke else SHAPES[name]

    def build(self, name: str, dtype=torch.bfloat16, tokenizer=None):
        """A randomly initialised causal LM of ``name``'s shape, made on the device, and a tokenizer."""
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        from dapo.model import tiny

        s = self.shape(name)
        tok = tokenizer or tiny.build_tokenizer()
        eos = tok.eos_token_id
        # (max: a smoke shape under a real tokenizer still embeds all of its ids)
        common = dict(
            vocab_size=max(s["vocab"], len(tok)),
            hidden_size=s["hidden"],
            intermediate_size=s["inter"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv"],
            max_position_embeddings=32768,
            tie_word_embeddings=s["tied"],
            pad_token_id=tok.pad_token_id,
            eos_token_id=eos,
            bos_token_id=None,
        )
        config = Qwen2Config(**common) if s["arch"] == "qwen2" else LlamaConfig(**common)
        torch.manual_seed(0)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, eos
        model.generation_config.bos_token_id = None
        return model, tok

    @contextlib.contextmanager
    def handed(self, model, tok):
        """Policy built on ``model`` itself: its loader returns the model instead of reading a directory."""
        import dapo.model.logprobs

        real = dapo.model.logprobs.load_model_and_tokenizer
        dapo.model.logprobs.load_model_and_tokenizer = lambda *a, **k: (model, tok)
        try:
            yield
        finally:
            dapo.model.logprobs.load_model_and_tokenizer = real

    def policy(self, model, tok, overrides: list[str]):
        from dapo.config import load_config
        from dapo.model.policy import Policy

        cfg = load_config(
            None,
            [
                "model.path=unused",
                f"model.device={self.device.type}",
                "model.dtype=bfloat16",
                "algo.soft_overlong_punishment=false",
                *overrides,
            ],
        )
        with self.handed(model, tok):
            policy = Policy(cfg.model, cfg.train, temperature=1.0, device=self.device)
        return policy, cfg

    def batch(self, prompts: int, group: int, prompt_len: int, response_lens: tuple[int, int], vocab: int):
        from dapo.algorithm import advantages
        from dapo.algorithm.batch import RolloutBatch

        rng = random.Random(0)
        gen = torch.Generator().manual_seed(0)
        n = prompts * group
        prompt_ids, response_ids = [], []
        for _ in range(prompts):
            p = torch.randint(2, min(vocab, 50000), (prompt_len,), generator=gen).tolist()
            for _ in range(group):
                prompt_ids.append(p)
                response_ids.append(
                    torch.randint(2, min(vocab, 50000), (rng.randint(*response_lens),), generator=gen).tolist()
                )
        reward = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
        b = RolloutBatch.of_responses(prompt_ids, response_ids, group_size=group, reward=reward)
        b.adv = advantages.group_advantages(reward, group)
        return b

    @staticmethod
    def old_logp(policy, batch) -> None:
        """old_logp from the policy itself, as the loop's old-log-prob pass gives it: the ratio starts at 1, inside
        the clip range, so every token has a gradient (a made-up old_logp could clip them all away)."""
        batch.old_logp, _ = policy.compute_logprobs(batch)

    def timed(self, fn, meter: Meter | None = None) -> float:
        """Wall seconds of ``fn()`` with the device synchronised; its CPU seconds and the load meanwhile go to
        ``meter`` (added up over calls), or to a meter of its own: ``self.last`` either way."""
        self.last = meter or self.meter()
        self.sync()
        with self.last:
            t0 = time.perf_counter()
            fn()
            self.sync()
            seconds = time.perf_counter() - t0
        return seconds

    def row(self, what: str, figure: str, note: str = "") -> None:
        line = f"| {what} | {figure} | {note} |"
        self.rows.setdefault(self.part, []).append(line)
        print(line, flush=True)
        if self.on_row is not None:
            self.on_row()

    @staticmethod
    def matmul_params(model) -> int:
        """Parameters that multiply activations: all of them but an input embedding that is not also the head."""
        total = sum(p.numel() for p in model.parameters())
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        return total if emb is head else total - emb.numel()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def pct(x) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def gib(x) -> str:
    return "n/a" if x is None else f"{x:.1f} GiB"
