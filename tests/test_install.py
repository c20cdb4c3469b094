"""A clean, non-editable install: a wheel built from a fresh clone, installed into a directory of its
own and run from outside the repository with no source tree on sys.path, runs the demo and finds every
preset, base model and data file the repository ships."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("configs", "assets", "data")

# Run the installed package only: sys.path keeps the install directory and drops every other entry that
# holds a `dapo` package (the checkout under test, an editable install's .pth), so a file left out of the
# wheel cannot be found in a source tree instead.
LAUNCHER = """\
import os, sys
site = sys.argv[1]
def holds_dapo(p):
    return os.path.exists(os.path.join(p or os.curdir, "dapo", "__init__.py"))
sys.path[:] = [p for p in sys.path if p == site or not holds_dapo(p)]
import dapo
assert dapo.__file__.startswith(site + os.sep), dapo.__file__
sys.argv = ["dapo", *sys.argv[2:]]
"""


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(install directory, a directory outside the repository, the environment to run in)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    tmp = tmp_path_factory.mktemp("install")
    run(["git", "clone", "--quiet", str(ROOT), str(tmp / "clone")])
    build = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "wheel"),
            str(tmp / "clone"),
        ]
    )
    lines = (build.stdout + build.stderr).lower().splitlines()
    assert not [line for line in lines if "licen" in line and "deprecat" in line], "a licence deprecation warning"
    (wheel,) = (tmp / "wheel").glob("dapo-*.whl")
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp / "site"), str(wheel)])
    outside = tmp / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp / "site")}
    return tmp / "site", outside, env


def python(installed, code: str, *args: str) -> subprocess.CompletedProcess:
    site, outside, env = installed
    return run([sys.executable, "-c", LAUNCHER + code, str(site), *args], cwd=outside, env=env, timeout=600)


def test_the_wheel_holds_every_shipped_file(installed):
    site, _, _ = installed
    tracked = run(["git", "ls-files", "--", *SHIPPED], cwd=ROOT).stdout.split()
    assert len(tracked) > 30  # presets, three base models, the benchmarks
    missing = [f for f in tracked if not (site / "dapo" / "share" / f).is_file()]
    assert not missing, missing
    differ = [f for f in tracked if (site / "dapo" / "share" / f).read_bytes() != (ROOT / f).read_bytes()]
    assert not differ, differ
    metadata = next(site.glob("dapo-*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text().splitlines()
    assert (metadata.parent / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


def test_presets_models_and_benchmarks_resolve_from_the_installed_package(installed):
    site, _, _ = installed
    out = python(
        installed,
        """
from dapo.config import load_config, resolve_preset
from dapo.evaluation import load_benchmark
from dapo.data.files import load_examples
from dapo.config.shipped import shipped
for name in ("demo", "smollm2_135m", "configs/dapo_qwen2.5_7b.yaml", "ablation/base"):
    print(resolve_preset(name))
cfg = load_config(["ablation/base", "ablation/3_clip_higher"])  # as dapo ablate layers them; the row names its bases
print(cfg.algo.eps_high, cfg.algo.kl_coef, shipped(cfg.model.path))
bench, examples = load_benchmark("aime2024")
print(bench.name, len(examples), len(load_examples("data/word_problems/train.jsonl")))
""",
    )
    share = site / "dapo" / "share"
    assert out.stdout.splitlines() == [
        str(share / "configs/demo.yaml"),
        str(share / "configs/smollm2_135m.yaml"),
        str(share / "configs/dapo_qwen2.5_7b.yaml"),
        str(share / "configs/ablation/base.yaml"),
        f"0.28 0.001 {share / 'assets/arith-loop-base'}",
        f"aime2024 30 {sum(1 for _ in (ROOT / 'data/word_problems/train.jsonl').open())}",
    ]


def test_the_installed_demo_runs_outside_the_repository(installed):
    _, outside, _ = installed
    out = python(
        installed,
        "from dapo.cli import main; sys.exit(main())",
        "demo",
        "train.total_steps=2",
        "train.prompts_per_step=8",
        "train.mini_batch_prompts=8",
        "eval.num_problems=8",
        "run.progress=false",
    )
    assert "held-out accuracy: arith avg@4" in out.stdout and "before ->" in out.stdout, out.stdout
    run_dir = outside / "runs" / "demo"
    assert (run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the evaluation before training, then the two steps
    assert (run_dir / "plots" / "training.png").is_file()
