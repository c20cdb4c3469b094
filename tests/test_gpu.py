"""The CUDA paths against the CPU and float32 ones (the items of `make gpu-check`: a, i and t here, b-g, m and n in
tests/test_gpu_paths.py; the demos are run by scripts/gpu_check.py).

Every test runs on each device of DEVICES: "cpu" always (CI has no GPU; the CPU run of the same test
catches the mistakes that are not CUDA's own: a tolerance that cannot hold, a comparison of the wrong
tensors, a path that does not run), "cuda" where a CUDA device is visible (marked ``gpu``). The
heavier CPU twins (a torchrun process, whole training runs) repeat what tests/test_parallel.py and
tests/test_update.py already check on CPU; they run only under ``DAPO_GPU_CHECK=1`` (set by
`make gpu-check`) so that CI does not pay for them twice. Each comparison states its tolerance and why.

  a  one update in float32 and bf16 in one process; under FSDP2 (torchrun, 1 rank: nccl on CUDA, gloo
     on CPU) with bf16 mixed precision, with train.cpu_offload and with activation checkpointing;
     against the single-process float32 update on the CPU
  i  GSPO and CISPO (algo.objective): one update in float32 and bf16 against the CPU float32 one
  t  train.kernels (torch.compile per decoder layer, Liger Kernel, both) against the CPU float32 update
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import loss_fn_of, make_policy, small_config  # noqa: E402
from dapo.reporting.run_log import read_metrics  # noqa: E402
from dapo.runtime import parallel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=ON_CUDA)]
# the CPU twin of a test whose CPU side tests/test_parallel.py or tests/test_train.py already covers
GPU_CHECK = os.environ.get("DAPO_GPU_CHECK") == "1"
CPU_TWIN_IN_GPU_CHECK = pytest.mark.skipif(not GPU_CHECK, reason="CPU twin of a covered test: make gpu-check runs it")
HEAVY_DEVICES = [pytest.param("cpu", marks=CPU_TWIN_IN_GPU_CHECK), pytest.param("cuda", marks=ON_CUDA)]
BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 of it


def env_for_children(**extra) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def report(item: str, **figures) -> None:
    """One line the gpu-check report collects (pytest -s): the measured differences beside their bounds."""
    print(
        f"\nGPU-CHECK {item} "
        + json.dumps({k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in figures.items()}),
        flush=True,
    )


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=ON_CUDA), pytest.param("bfloat16", marks=ON_CUDA)])
def test_two_steps_on_gpu(tiny_model_dir, tmp_path, dtype):
    cfg = small_config(tmp_path, tiny_model_dir, "model.device=cuda", f"model.dtype={dtype}")
    from dapo.training import train

    train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) for r in rows)


# ---- a: one update, float32 / bf16 / FSDP2 ------------------------------------------------------
# one optimizer update of plain SGD at lr 1 and no clipping: the weight change is minus the gradient
ONE_SGD_UPDATE = [
    "train.prompts_per_step=3",
    "train.mini_batch_prompts=3",
    "train.micro_batch_size=2",
    "train.grad_clip=1e9",
]
FSDP_VARIANTS = {  # name: overrides (every one computes in bf16 with float32 masters, as the presets train)
    "fp32": [],
    "bf16": ["model.dtype=bfloat16"],
    "bf16_offload": ["model.dtype=bfloat16", "train.cpu_offload=true"],
    "bf16_checkpointing": ["model.dtype=bfloat16", "model.gradient_checkpointing=true"],
}


def sgd_update(cfg, device: str, batch, d=None, *, recompute_old: bool = False) -> dict:
    """log-probs, the statistics and minus the gradient (an SGD step at lr 1) of one update on ``batch``,
    every tensor on the CPU in float32, keyed by the base model's parameter names. ``recompute_old``: the
    update's old_logp is this policy's own pass (as the loop recomputes it), not the batch's."""
    policy = make_policy(cfg, device, d)
    trained = policy.master or [p for p in policy.model.parameters() if p.requires_grad]  # float32 either way
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    policy.optimizer = torch.optim.SGD(trained, lr=1.0)
    old_logp, _ = policy.compute_logprobs(batch)
    if recompute_old:
        batch = copy.copy(batch)
        batch.old_logp = old_logp
    before = {n: t.clone() for n, t in parallel.full_tensors(zip(names, trained))}  # DTensors gathered
    stats = policy.update(batch, loss_fn_of(cfg))
    delta = {n: (t - before[n]).float().cpu() for n, t in parallel.full_tensors(zip(names, trained))}
    return {
        "old_logp": old_logp,
        "stats": {k: float(v) for k, v in stats.items()},
        "delta": delta,
        "dtypes": sorted({str(p.dtype) for p in trained}),
        "dtensors": all(hasattr(p, "full_tensor") for p in trained),
    }


@pytest.fixture(scope="module")
def reference_update(tiny_model_dir, tmp_path_factory):
    """The batch every variant trains on (sampled on the CPU) and the single-process float32 update on the CPU."""
    from conftest import sampled_batch

    tmp = tmp_path_factory.mktemp("reference-update")
    cfg = small_config(tmp, tiny_model_dir, *ONE_SGD_UPDATE)
    torch.manual_seed(0)
    batch = sampled_batch(make_policy(cfg))  # 3 prompts x 4 samples, old log-probs from the same weights
    torch.save(batch, tmp / "batch.pt")
    return batch, sgd_update(cfg, "cpu", batch), tmp


def compare(got: dict, want: dict) -> dict:
    scale = max(v.abs().max().item() for v in want["delta"].values())
    diff = max((got["delta"][k] - want["delta"][k]).abs().max().item() for k in want["delta"])
    l1 = sum((got["delta"][k] - want["delta"][k]).abs().sum().item() for k in want["delta"])
    l1_ref = sum(v.abs().sum().item() for v in want["delta"].values())
    return {
        "grad_max_abs_diff": diff,
        "grad_scale": scale,
        "grad_rel_l1": l1 / l1_ref,
        "loss_diff": abs(got["stats"]["pg_loss"] - want["stats"]["pg_loss"]),
        "logp_max_abs_diff": (got["old_logp"] - want["old_logp"]).abs().max().item(),
    }


# float32 on another device: the same arithmetic in another summation order (TF32 is off by default in
# torch; were it on, matmuls would keep 10 bits and this would fail, as it should): 1e-4 of the largest
# gradient, 1e-5 on the loss and log-probs (~100x float32's 1.2e-7 for sums over a few hundred terms).
# bf16 compute: the weights and every activation rounded to 8 bits (BF16_EPS) through 2 layers and the
# head: 2% of the largest gradient entry (~5 roundings), 3% of the gradient's L1 norm, the loss within 2e-3
# (each token's ratio carries ~4e-3 of rounded log-prob, averaged over ~100 tokens of both advantage signs)
# and log-probs within 0.05 (a logit of size ~5 rounded: 5 x 2^-8 = 0.02, in both log-sum-exp and target).
TOLERANCE = {
    "float32": dict(grad=1e-4, l1=1e-4, loss=1e-5, logp=1e-5),
    "bfloat16": dict(grad=0.02, l1=0.03, loss=2e-3, logp=0.05),
}


def assert_within(found: dict, dtype: str) -> None:
    tol = TOLERANCE[dtype]
    assert found["grad_scale"] > 1e-3  # the update did something
    assert found["grad_max_abs_diff"] <= tol["grad"] * found["grad_scale"], found
    assert found["grad_rel_l1"] <= tol["l1"], found
    assert found["loss_diff"] <= tol["loss"], found
    assert found["logp_max_abs_diff"] <= tol["logp"], found


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_update_in_one_process_agrees_with_cpu_float32(reference_update, tiny_model_dir, device, dtype):
    """bf16 keeps float32 masters (Policy._master_weights): the gradient lands in float32 copies."""
    batch, want, tmp = reference_update
    cfg = small_config(tmp / f"{device}-{dtype}", tiny_model_dir, *ONE_SGD_UPDATE, f"model.dtype={dtype}")
    got = sgd_update(cfg, device, batch)
    assert got["dtypes"] == ["torch.float32"] and not got["dtensors"]  # the masters (bf16) or the weights (float32)
    found = compare(got, want)
    report(f"a single-process {device} {dtype}", **found, tolerance=TOLERANCE[dtype])
    if device == "cpu" and dtype == "float32":
        assert (
            found["grad_max_abs_diff"] == 0.0
        )  # the reference itself: the comparison sees a difference when there is one
    assert_within(found, dtype)


# ---- i: the objectives beside DAPO's (algo.objective) ---------------------------------------------------
OBJECTIVE_ROWS = {  # as configs/objectives/ sets each one
    "gspo": ["algo.objective=gspo", "algo.eps_low=3e-4", "algo.eps_high=4e-4", "algo.loss_agg=seq-mean-token-mean"],
    "cispo": ["algo.objective=cispo", "algo.eps_low=1", "algo.eps_high=4"],
}


# the CPU twin runs in make gpu-check only: tests/test_objectives.py has the maths on the CPU
@pytest.mark.parametrize("device", HEAVY_DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("objective", list(OBJECTIVE_ROWS))
def test_each_objective_update_agrees_with_cpu_float32(reference_update, tiny_model_dir, objective, device, dtype):
    """GSPO's sequence ratio and CISPO's detached weight on the device and in bf16: the same update as on the CPU in
    float32, within the tolerances of DAPO's own loss (item a). Each side's old_logp is its own pass, as the loop
    recomputes it: GSPO's clip range (4e-4) is far below bf16's rounding of a log-prob, so a ratio against another
    dtype's log-probs would clip every sequence."""
    batch, _, tmp = reference_update
    rows = [*ONE_SGD_UPDATE, *OBJECTIVE_ROWS[objective]]
    ref_cfg = small_config(tmp / f"{objective}-ref", tiny_model_dir, *rows)
    want = sgd_update(ref_cfg, "cpu", batch, recompute_old=True)
    cfg = small_config(tmp / f"{objective}-{device}-{dtype}", tiny_model_dir, *rows, f"model.dtype={dtype}")
    got = sgd_update(cfg, device, batch, recompute_old=True)
    found = compare(got, want)
    report(f"i {objective} {device} {dtype}", **found, tolerance=TOLERANCE[dtype])
    assert_within(found, dtype)


# ---- t: faster kernels (train.kernels) ---------------------------------------------------------------------
@pytest.fixture
def liger_patches_undone():
    """Liger patches the transformers module of the model type (its RoPE function, its norm and MLP classes) for
    the whole process: put the module back, so that later tests build and run the eager model."""
    from transformers.models.qwen2 import modeling_qwen2

    saved = dict(vars(modeling_qwen2))
    yield
    for name, value in saved.items():
        setattr(modeling_qwen2, name, value)


KERNEL_CASES = [  # (train.kernels, device, dtype): compile also on the CPU (tests/test_kernels.py has more there)
    pytest.param("compile", "cpu", "float32", marks=CPU_TWIN_IN_GPU_CHECK),
    *[
        pytest.param(kernels, "cuda", dtype, marks=ON_CUDA)
        for kernels in ("compile", "liger", "compile,liger")
        for dtype in ("float32", "bfloat16")
    ],
]


@pytest.mark.parametrize("kernels,device,dtype", KERNEL_CASES)
def test_faster_kernels_update_agrees_with_cpu_float32(
    reference_update, tiny_model_dir, liger_patches_undone, kernels, device, dtype
):
    """torch.compile per decoder layer and Liger Kernel's RMSNorm, SwiGLU and RoPE: log-probs, loss and gradient of
    one update within the tolerances of the eager update on the same device and dtype (item a)."""
    batch, want, tmp = reference_update
    cfg = small_config(tmp / f"kernels-{kernels}-{device}-{dtype}", tiny_model_dir, *ONE_SGD_UPDATE,
                       f"model.dtype={dtype}", f"train.kernels=[{kernels}]")  # fmt: skip
    got = sgd_update(cfg, device, batch)
    if "liger" in kernels:  # the kernels were really swapped in
        assert make_policy(cfg, device).model.model.norm._get_name() == "LigerRMSNorm"
    found = compare(got, want)
    report(f"t kernels={kernels} {device} {dtype}", **found, tolerance=TOLERANCE[dtype])
    assert_within(found, dtype)


class OneRankFSDP(parallel.Dist):
    """A process group of one rank that shards anyway: FSDP2's code path (fully_shard, mixed precision,
    offload, DTensor gathers) on a machine with one GPU. ``parallel.init`` leaves a world of 1 unsharded."""

    @property
    def sharded(self) -> bool:
        return True


def fsdp_worker(device: str, model_dir: str, batch_file: str, out_dir: str) -> None:
    """Run under torchrun with 1 process: each FSDP variant's update on the test's batch."""
    import torch.distributed as dist

    from dapo.config import ConfigError

    if device == "cuda":
        torch.cuda.set_device(0)  # before the group, as parallel.init does
    # the backend parallel.init picks: nccl on CUDA (every collective of FSDP2's on the GPU), gloo on CPU
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    d = OneRankFSDP(rank=0, world_size=1, device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    batch = torch.load(batch_file, weights_only=False)
    results = {}
    for name, overrides in FSDP_VARIANTS.items():
        cfg = small_config(Path(out_dir) / name, model_dir, *ONE_SGD_UPDATE, *overrides)
        try:
            results[name] = sgd_update(cfg, device, batch, d)
        except ConfigError as err:  # train.cpu_offload on CPU: refused in one line
            results[name] = {"error": str(err)}
        except Exception:  # noqa: BLE001 - one variant's failure (a CUDA path) must not hide the others'
            import traceback

            results[name] = {"error": traceback.format_exc()}
    torch.save(results, Path(out_dir) / "fsdp.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("device", HEAVY_DEVICES)
def test_fsdp2_one_rank_agrees_with_cpu_float32(reference_update, tiny_model_dir, device):
    """FSDP2 keeps float32 masters sharded and computes in model.dtype (MixedPrecisionPolicy, float32
    reduction): the bf16 variants take the bf16 tolerance, the float32 one the float32 tolerance.
    train.cpu_offload is CUDA-only: on CPU the config is refused with one line naming the key."""
    batch, want, tmp = reference_update
    out = tmp / f"fsdp-{device}"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        __file__,
        "fsdp",
        device,
        str(tiny_model_dir),
        str(tmp / "batch.pt"),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env_for_children(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = torch.load(out / "fsdp.pt", weights_only=False)
    failed = {
        name: got["error"][-1500:]
        for name, got in results.items()
        if "error" in got and not (name == "bf16_offload" and device == "cpu")
    }
    assert not failed, failed
    for name, got in results.items():
        if name == "bf16_offload" and device == "cpu":
            assert "train.cpu_offload=true" in got["error"] and "CUDA" in got["error"], got
            continue
        assert got["dtypes"] == ["torch.float32"] and got["dtensors"], name  # sharded float32 masters
        dtype = "float32" if name == "fp32" else "bfloat16"
        found = compare(got, want)
        report(f"a fsdp2-1rank {device} {name}", **found, tolerance=TOLERANCE[dtype])
        assert_within(found, dtype)


if __name__ == "__main__":  # the torchrun worker
    mode, *rest = sys.argv[1:]
    {"fsdp": fsdp_worker}[mode](*rest)
