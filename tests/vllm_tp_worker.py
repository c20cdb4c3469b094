"""torchrun worker for tests/test_vllm.py: two gloo ranks share one vLLM engine (tensor_parallel_size=2,
external_launcher). Writes, per rank, the samples before and after a weight push and the trainer's
log-probs of the pushed weights on the samples drawn after it."""

import json
import os
import sys

import torch

from dapo import parallel
from dapo.config import load_config
from dapo.policy import load_model_and_tokenizer
from dapo.rollout import SamplingParams, ShardedRollout, make_rollout
from dapo.train import weightless_model

PARAMS = SamplingParams(n=2, temperature=0.7, max_new_tokens=24, seed=5)  # temperature as in test_vllm's config


def perturbed(model):
    """A deterministic weight change big enough to move every log-prob (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.float().std().clamp(min=1e-3))
    return model


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    d = parallel.init("cpu")
    cfg = load_config("configs/demo.yaml", [f"model.path={model_dir}", "rollout.backend=vllm", "rollout.kv_cache_gib=0.0625",
                                            "rollout.tensor_parallel_size=2", "model.device=cpu"])
    model, tok = load_model_and_tokenizer(model_dir)
    engine = ShardedRollout(make_rollout(cfg.rollout, weightless_model(model_dir, "float32"), tok), d, tensor_parallel_size=2)
    prompts = [tok(p)["input_ids"] for p in ("2+7*4=", "9=", "7-")]
    before = engine.generate(prompts, PARAMS)
    engine.update_weights(perturbed(model).named_parameters())
    after = engine.generate(prompts, PARAMS)
    out = {name: {"response_ids": g.response_ids, "logprobs": g.logprobs} for name, g in (("before", before), ("after", after))}
    with open(os.path.join(out_dir, f"rank{d.rank}.json"), "w") as f:
        json.dump(out, f)
    parallel.shutdown(d)


if __name__ == "__main__":
    main(*sys.argv[1:])
