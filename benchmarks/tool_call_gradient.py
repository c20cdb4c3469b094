"""Does a DAPO step push the policy towards calling the tool? The first step's gradient, read off before any update.

    python benchmarks/tool_call_gradient.py                                   # the tool demo's base model
    python benchmarks/tool_call_gradient.py --model /tmp/other-base          # another base (make_base_model.py)

One step of configs/demo_tools.yaml is collected as training collects it (generation with the tool, grading,
dynamic sampling, group-normalised advantages); before the update, the on-policy surrogate's gradient (ratio 1:
sum of A_i * log pi over the trained tokens, token-mean) is taken and projected on the gradient of the mean
log-probability of opening a tool call (the first "`") on 36 held-out prompts. Printed: that projection for a
plain gradient step and for Adam's first step (the sign of the gradient), for the whole batch, for the first
token of every response only, and for the rows that called the tool and those that did not; and the advantage
and accuracy of each kind of row. Positive: the step makes calls more likely.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


class Collected(BaseException):  # not an Exception: the loop turns those into a StepError
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "arith-tools-base"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    import dapo.model.policy
    from dapo import training
    from dapo.config import load_config

    overrides = [f"model.path={args.model}", "train.total_steps=1", "eval.before_train=false", "eval.every_steps=null"]
    overrides += ["run.save_every=null", "run.dir=/tmp", "run.name=tool_call_gradient", "run.progress=false"]
    overrides += ["run.loggers=[console]", f"train.seed={args.seed}", f"rollout.seed={args.seed}"]
    cfg = load_config(str(ROOT / "configs" / "demo_tools.yaml"), overrides)
    seen = {}

    def update(self, batch, loss_fn, **kw):  # the trained batch and the weights that sampled it, before the update
        seen["batch"], seen["model"] = batch, self.model
        raise Collected

    dapo.model.policy.Policy.update = update
    try:
        training.train(cfg)
    except Collected:
        pass
    batch, model = seen["batch"], seen["model"]
    tok = AutoTokenizer.from_pretrained(args.model)
    fence = tok.encode("`", add_special_tokens=False)[0]
    params = [p for p in model.parameters() if p.requires_grad]

    def grad(loss):
        g = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if x is None else x for x, p in zip(g, params)]

    prompts = [f"{a}+{b}*{c}=" for a in range(1, 10) for b in (2, 5) for c in (3, 7)]
    opens = sum(
        torch.log_softmax(model(torch.tensor([tok.encode(p, add_special_tokens=False)])).logits[0, -1].float(), -1)[
            fence
        ]
        for p in prompts
    )
    towards_call = grad(opens / len(prompts))
    mask = batch.response_mask()
    denom = float(mask.sum())

    def surrogate(rows, first_only=False):
        total = 0.0
        for i in rows:
            prompt, response = batch.prompt_ids[i], batch.response_ids[i]
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            m = mask[i, : len(response)].clone()
            if first_only:
                m[1:] = 0
            total = total - batch.adv[i] * (m * logp).sum()
        return total / denom

    def along(g):  # first-order change of the probe under a descent step along -g: plain, and Adam's sign step
        plain = -sum((a * b).sum() for a, b in zip(towards_call, g)).item()
        sign = -sum((a * b.sign()).sum() for a, b in zip(towards_call, g)).item()
        return f"gradient step {plain:+.3g}   Adam's first step {sign:+.3g}"

    called = [i for i in range(len(batch)) if batch.tool_mask and any(batch.tool_mask[i])]
    wrote = [i for i in range(len(batch)) if i not in set(called)]
    every = list(range(len(batch)))
    print(f"{args.model}: {len(batch)} trained rows, {len(called)} called the tool")
    for rows, name in ((called, "called"), (wrote, "did not call")):
        if rows:
            adv, acc = batch.adv[rows].mean().item(), batch.acc[rows].mean().item()
            print(f"  rows that {name}: mean advantage {adv:+.3f}, accuracy {acc:.3f}")
    print("change of log p(open a call) on held-out prompts, per unit step:")
    print(f"  whole batch          {along(grad(surrogate(every)))}")
    print(f"  first tokens only    {along(grad(surrogate(every, first_only=True)))}")
    print(f"  rows that called     {along(grad(surrogate(called)))}")
    print(f"  rows that did not    {along(grad(surrogate(wrote)))}")


if __name__ == "__main__":
    main()
