"""Shared fixtures: a tiny random Qwen2 model and tokenizer built locally (no downloads)."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in more workers than cores (TEST_WORKERS): one torch thread each, for the tests and
    # the processes they start, so the workers do not fight over the cores each would otherwise take all of
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import importlib.abc
import importlib.util
import sys

import pytest

from dapo.config import load_config


class _InspectModelsInProcess(importlib.abc.MetaPathFinder):
    """vLLM inspects each model architecture the first time it meets it in a Python process of its own, so as not
    to initialise CUDA in the caller (about 10 CPU seconds each: Python, torch and vLLM imported again); it keeps the
    result in VLLM_CACHE_ROOT for later runs. Where there is no CUDA to initialise, the suite's processes inspect in
    their own process: the same inspection, cached the same way, without the new process."""

    MODULE = "vllm.model_executor.models.registry"

    def find_spec(self, name, path=None, target=None):
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module._run_in_subprocess = lambda inspect: inspect()

        spec.loader.exec_module = exec_module
        return spec


if not os.path.exists("/dev/nvidiactl"):
    sys.meta_path.insert(0, _InspectModelsInProcess())

pytest_plugins = ["cpu_seconds"]  # each test's CPU seconds, and the 15 that took the most (tests/cpu_seconds.py)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from dapo.model import tiny

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    tiny.save(model, tokenizer, path)
    return path


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory):
    """tiny_model_dir's architecture and tokenizer with other weights (seed 1): another revision, a teacher."""
    from dapo.model import tiny

    path = tmp_path_factory.mktemp("tiny-model-seed1")
    tokenizer = tiny.build_tokenizer()
    tiny.save(tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=1), tokenizer, path)
    return path


# a training config that runs a step in about a second on 2 CPU cores (as dotted overrides of the demo)
SMALL_OVERRIDES = [
    "run.name=t",
    "run.progress=false",
    "run.loggers=console",
    "train.total_steps=2",
    "train.prompts_per_step=4",
    "train.mini_batch_prompts=2",
    "train.max_tokens_per_micro_batch=256",
    # the reference's layout, each response with its own copy of the prompt; the demo's shared prompts are tested
    # in test_prefix.py and test_arch_matrix.py, and on the demo preset wherever a test loads it without these
    "train.share_prompt_prefix=false",
    "rollout.group_size=4",
    "rollout.max_response_tokens=16",
    "algo.overlong_buffer_tokens=4",
    "algo.dynamic_sampling=false",
    "eval.num_problems=4",
    "eval.n=2",
    "eval.every_steps=null",
    "eval.before_train=false",
    "reward.num_workers=1",
    "train.lr=1e-3",
    "train.warmup_steps=0",
]


def small_config(run_dir, model_dir, *extra):
    """A training config that runs a step in about a second on 2 CPU cores."""
    return load_config("configs/demo.yaml", [f"model.path={model_dir}", f"run.dir={run_dir}", *SMALL_OVERRIDES, *extra])


def train_in_one_thread(cfg) -> None:
    """Train ``cfg`` in this process with one torch thread, as a launched run with OMP_NUM_THREADS=1 trains: its sums
    in the same order, so the two runs compare bit for bit."""
    import torch

    from dapo.training import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)


def make_policy(cfg, device="cpu", dist=None):
    """The policy a training run with ``cfg`` trains, on ``device``."""
    import torch

    from dapo.model.policy import Policy

    return Policy(
        cfg.model,
        cfg.train,
        dist,
        temperature=cfg.rollout.temperature,
        device=torch.device(device),
        max_seq_tokens=cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens,
    )


def training_engine(cfg, policy, dist):
    """The rollout engine a training run with ``cfg`` builds for ``policy`` (None: only the checks)."""
    from dapo.rollout import build

    return build.training_engine(cfg, policy, dist)


def loss_fn_of(cfg):
    """The loss a training run with ``cfg`` gives ``Policy.update``."""
    from dapo.algorithm.step import make_loss_fn

    return make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)


SKIP_SANDBOX_ENV = "DAPO_SKIP_SANDBOX_TESTS"  # =1: skip the sandbox tests on a machine that cannot run them


def sampled_batch(policy, group_size=4, prompts=("1+2=", "3*4-5=", "6+7*2=")):
    """A graded rollout batch of ``policy``'s own samples (HF generate, seed 0), every third response right, with
    its advantages and the policy's log-probs and entropies: the input of an update."""
    import torch

    from dapo.algorithm import advantages
    from dapo.algorithm.batch import RolloutBatch
    from dapo.rollout import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(policy.model, policy.tokenizer)
    ids = [policy.tokenizer(p)["input_ids"] for p in prompts]
    gen = engine.generate(ids, SamplingParams(n=group_size, max_new_tokens=10, seed=0))
    reward = torch.tensor([1.0 if i % 3 == 0 else -1.0 for i in range(len(gen.response_ids))])
    batch = RolloutBatch.from_generation(gen, group_size=group_size, reward=reward)
    batch.adv = advantages.group_advantages(batch.reward, group_size)
    batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
    return batch


def sgd(policy) -> None:
    """Plain SGD at lr 1: an update moves the weights by minus the (unclipped) gradient."""
    import torch

    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)


def sandbox_unavailable() -> str | None:
    """Why the tool sandbox cannot start on this machine (the check's one line), else None."""
    global _SANDBOX_WHY
    if _SANDBOX_WHY is None:
        import sys

        from dapo.tools.sandbox import Sandbox, SandboxUnavailable

        try:
            if not sys.platform.startswith("linux"):
                raise SandboxUnavailable("the tool sandbox (bubblewrap) is Linux-only")
            Sandbox().check()
            _SANDBOX_WHY = ""
        except SandboxUnavailable as err:
            _SANDBOX_WHY = str(err)
    return _SANDBOX_WHY or None


_SANDBOX_WHY: str | None = None
_SANDBOX_SKIPPED: set[str] = set()


# The files whose tests take the most wall seconds (`make test` idle and on the emulated slower machine of
# scripts/slow_machine_test.sh, 2026-11-29), longest first:
# pytest-xdist (--dist loadfile --no-loadscope-reorder, as `make test` runs it) hands each worker whole files in
# collection order, so these go first and no long file starts last and keeps one worker busy after the others are done.
# The Ray file waits more than it computes, on a cluster of many processes that slows down many times over beside the
# launches that take the most CPU (its two-node test: 166 s after them, 985 s beside them, emulated): it follows them
LONGEST_FILES = (
    "test_kernels.py", "test_rollout_ranks.py", "test_preemption.py", "test_arch_matrix.py", "test_parallel.py",
    "test_vllm.py", "test_ray.py", "test_api.py", "test_async_rollout.py", "test_elastic.py", "test_ablate.py",
    "test_reliability.py", "test_vllm_real.py", "test_screening.py", "test_trackers.py",
)  # fmt: skip


def longest_files_first(items) -> None:
    """Reorder ``items`` in place: the tests of LONGEST_FILES first, in that order, then the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_collection_modifyitems(config, items):
    """The longest files first (``longest_files_first``). Tests marked ``sandbox`` run code in the tool sandbox (the
    hostile-program suite among them). Where
    bubblewrap is installed and no sandbox starts, each fails with the check's line (``pytest_runtest_setup``): a
    green run means they ran. They skip only without bubblewrap (``make test`` installs it where it can) or when
    DAPO_SKIP_SANDBOX_TESTS=1 says so, and the summary then counts them."""
    import os
    import shutil

    longest_files_first(items)
    marked = [item for item in items if item.get_closest_marker("sandbox")]
    why = sandbox_unavailable() if marked else None
    if why is None or (shutil.which("bwrap") and os.environ.get(SKIP_SANDBOX_ENV) != "1"):
        return
    reason = why if shutil.which("bwrap") is None else f"{SKIP_SANDBOX_ENV}=1 ({why})"
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=f"no tool sandbox here: {reason}"))
        _SANDBOX_SKIPPED.add(item.nodeid)


def pytest_runtest_setup(item):
    """Runs before the test's fixtures, so before a module's own sandbox fixture tries to start one."""
    if item.get_closest_marker("sandbox") and item.nodeid not in _SANDBOX_SKIPPED and sandbox_unavailable():
        pytest.fail(
            f"{sandbox_unavailable()} (to skip the sandbox tests on this machine instead: {SKIP_SANDBOX_ENV}=1)",
            pytrace=False,
        )


def pytest_terminal_summary(terminalreporter):
    if _SANDBOX_SKIPPED:
        terminalreporter.write_line(
            f"sandbox tests: {len(_SANDBOX_SKIPPED)} did not run (the hostile-program suite among them): "
            f"{sandbox_unavailable()}",
            yellow=True,
        )


def objective_loss(name, logp, old_logp, adv, mask, **settings):
    """``losses.actor_loss`` under the objective ``name``: its settings (eps_low, loss_agg, dual_clip, ...) and the
    batch's (num_tokens, num_seqs, is_weights, ref_logp) by keyword."""
    from dapo.algorithm import losses

    batch = {k: settings.pop(k) for k in ("num_tokens", "num_seqs", "is_weights", "ref_logp") if k in settings}
    return losses.actor_loss(logp, old_logp, adv, mask, losses.Objective(name, **settings), **batch)


# ---- on-policy distillation: teachers with the student's tokenizer (tests/test_distillation*.py)
@pytest.fixture(scope="session")
def teacher_dir(other_tiny_model_dir):
    """A tiny model with the student's tokenizer (tiny_model_dir's) and other weights."""
    return other_tiny_model_dir


SMOLLM2_TOKENIZER = "tests/assets/smollm2-tokenizer"  # SmolLM2-135M-Instruct's tokenizer files


@pytest.fixture(scope="session")
def real_tokenizer_dirs(tmp_path_factory):
    """Two tiny models (other seeds) with SmolLM2-135M-Instruct's own tokenizer, a byte-level BPE of 49,152
    tokens: student and teacher."""
    from transformers import AutoTokenizer

    from dapo.model import tiny

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    dirs = []
    for name, seed in (("student", 0), ("teacher", 1)):
        path = tmp_path_factory.mktemp(f"smol-tokenizer-{name}")
        tiny.save(tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=seed), tokenizer, path)
        dirs.append(path)
    return dirs
