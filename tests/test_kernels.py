"""train.kernels: torch.compile per decoder layer computes what the eager model computes (to float32 rounding), in
the log-probs and in training; Liger Kernel is refused in one line where it cannot run (its CUDA check is in
tests/test_gpu.py)."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_policy, small_config
from dapo.config import ConfigError, load_config
from dapo.model import kernels
from dapo.training import train
from test_async_rollout import rows_of


# the full model's compiled layers train as its eager ones under FSDP on two ranks (the last test): the same losses,
# gradient norms and final weights; here, the layers with LoRA's adapters inside them, then also checkpointed (the
# second case reuses the first one's compiled graphs: each case with a graph of its own costs about 40 CPU seconds
# of compiling on a fresh machine)
@pytest.mark.parametrize(
    "extra",
    [["model.lora.rank=4"], ["model.lora.rank=4", "model.gradient_checkpointing=true"]],
    ids=["lora", "lora-checkpointing"],
)
def test_every_decoder_layer_is_compiled_and_gives_the_eager_logits_and_gradients(tiny_model_dir, tmp_path, extra):
    eager = make_policy(small_config(tmp_path, tiny_model_dir, *extra))
    compiled = make_policy(small_config(tmp_path, tiny_model_dir, "train.kernels=[compile]", *extra))
    layers = kernels.decoder_layers(compiled.model)
    assert len(layers) == compiled.model.config.num_hidden_layers == 2
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in kernels.decoder_layers(eager.model))
    torch.manual_seed(0)
    ids = torch.randint(3, eager.model.config.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    for length in (11, 7):  # a second shape reuses the dynamic graph
        keep = mask[:, :length].bool()
        logits = []
        for policy in (eager, compiled):
            policy.model.zero_grad()
            out = policy.model(input_ids=ids[:, :length], attention_mask=mask[:, :length]).logits
            out[keep].log_softmax(-1)[:, 5].sum().backward()
            logits.append(out.detach())
        a, b = logits
        assert (a - b)[keep].abs().max() < 1e-5 < a[keep].abs().max()
        grads = [{n: p.grad for n, p in m.model.named_parameters() if p.grad is not None} for m in (eager, compiled)]
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
        assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) < 1e-5


def test_liger_kernels_where_they_cannot_run_are_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^train.kernels=\[liger\]: its Triton kernels run on CUDA only, and the "
                                          r"trainer runs on cpu; or leave liger out of train.kernels$"):  # fmt: skip
        make_policy(small_config(tmp_path, tiny_model_dir, "train.kernels=[liger]"))


def test_compiled_layers_with_the_shared_prompt_prefix_are_refused_in_one_line():
    """Measured on SmolLM2 (30 layers): the cache's layer index made every layer recompile, and past torch's limit of
    8 the rest ran eagerly; refused rather than half compiled."""
    from dapo.config import validate

    with pytest.raises(ConfigError, match=r"^train.kernels=\[compile\] with train.share_prompt_prefix=true would "):
        validate(load_config("configs/smollm2_135m.yaml", ["train.kernels=[compile]"]))


def test_an_unknown_kernel_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^train.kernels=\['flash'\]: must list only compile and liger \(\[\]: eager\)$"
    ):
        load_config("configs/demo.yaml", ["train.kernels=[flash]"])


@pytest.mark.slow
def test_compiled_layers_under_fsdp_on_two_ranks_train_as_eager_ones(tiny_model_dir, tmp_path):
    """torchrun, 2 ranks (gloo, FSDP2), the layers compiled before sharding, against one eager process, two steps
    each with the same seeds: the same samples, losses and gradient norms to float32 rounding, and final weights
    within 1e-5 where training moved them by far more: a compiled run trains as the eager one does, sharded or not
    (one process's compiled layers against its eager ones: the test above). Two ranks give one process's gradients to
    within 5e-8 (tests/test_parallel.py), so the eager side runs here, in this process; the ranks sample the whole
    batch with its seed (``whole_batches``)."""
    from test_parallel import torchrun
    from test_rollout_ranks import weights

    train(small_config(tmp_path / "eager", tiny_model_dir, *RUN))
    torchrun(__file__, "compiled", tiny_model_dir, tmp_path / "compiled", timeout=TORCHRUN_TIMEOUT_S)
    a, b = ({r["step"]: r for r in rows_of(tmp_path / n) if "actor/grad_norm" in r} for n in ("eager", "compiled"))
    for t in (1, 2):
        assert a[t]["rollout/response_length_mean"] == b[t]["rollout/response_length_mean"]
        assert abs(a[t]["actor/pg_loss"] - b[t]["actor/pg_loss"]) < 1e-5
        assert abs(a[t]["actor/grad_norm"] - b[t]["actor/grad_norm"]) < 1e-5 * a[t]["actor/grad_norm"]
    w_a, w_b = weights(tmp_path / "eager", 2), weights(tmp_path / "compiled", 2)
    base = load_file(next(tiny_model_dir.glob("model*.safetensors")))
    gap = max((w_a[n] - w_b[n]).abs().max().item() for n in w_a)
    moved = max((w_a[n] - base[n]).abs().max().item() for n in w_a)
    print(f"\ncompiled on 2 ranks vs eager on 1: largest weight gap {gap:.2e}, the weights moved by {moved:.2e}")
    assert w_a.keys() == w_b.keys() and gap < 1e-5 < 1e-4 < moved


# two steps, the last one saved; no held-out evaluation at the last step: not what these runs compare
RUN = ["train.total_steps=2", "run.save_every=2", "eval.benchmarks=[]"]
TORCHRUN_TIMEOUT_S = 900  # the launch takes about 150 s on a loaded 2-core machine


def whole_batches() -> None:
    """Every rank samples all of a round's prompts with the round's seed, as one process does (a run samples a
    share per rank, with a seed per share), so the ranks train on the one process's samples."""
    from dapo.rollout import ShardedRollout

    ShardedRollout.generate = lambda self, prompt_ids, params: self.engine.generate(prompt_ids, params)


def compiled_worker(model_dir: str, run_dir: str) -> None:
    """Under torchrun: two steps with the decoder layers compiled before FSDP shards them."""
    whole_batches()
    train(small_config(Path(run_dir), model_dir, "train.kernels=[compile]", *RUN))


if __name__ == "__main__":  # the torchrun worker
    mode, *rest = sys.argv[1:]
    {"compiled": compiled_worker}[mode](*rest)
