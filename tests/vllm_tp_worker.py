"""torchrun worker for tests/test_vllm.py: two gloo ranks train with FSDP and share one vLLM engine
(rollout.tensor_parallel_size=2, external_launcher), built by ``rollout.build.training_engine`` as a training run
builds it. Writes, per rank, the samples before and after a weight push from the sharded trainer."""

import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from conftest import make_policy, small_config, training_engine
from dapo.rollout import SamplingParams
from dapo.runtime import parallel

PARAMS = SamplingParams(n=2, temperature=0.7, max_new_tokens=24, seed=5)  # temperature as in test_vllm's config
OVERRIDES = ("rollout.backend=vllm", "rollout.kv_cache_gib=0.0625", "model.device=cpu", "rollout.temperature=0.7")
PROMPTS = ("2+7*4=", "9=", "7-")


def perturb(model) -> None:
    """A fixed weight change, big enough to move every log-prob; the same on one rank or sharded over two."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            noise = 0.01 * torch.randn(p.shape, generator=g)
            p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    d = parallel.init("cpu")
    cfg = small_config(out_dir, model_dir, *OVERRIDES, "rollout.tensor_parallel_size=2")
    policy = make_policy(cfg, d.device, d)
    engine = training_engine(cfg, policy, d)
    prompts = [policy.tokenizer(p)["input_ids"] for p in PROMPTS]
    before = engine.generate(prompts, PARAMS)
    perturb(policy.model)
    engine.update_weights(policy.named_weights())  # DTensor shards, gathered tensor by tensor
    after = engine.generate(prompts, PARAMS)
    out = {
        name: {"response_ids": g.response_ids, "logprobs": g.logprobs}
        for name, g in (("before", before), ("after", after))
    }
    with open(os.path.join(out_dir, f"rank{d.rank}.json"), "w") as f:
        json.dump(out, f)
    parallel.shutdown(d)


if __name__ == "__main__":
    main(*sys.argv[1:])
