"""`make gpu-check`: every CUDA path of dapo on a GPU machine, offline, in one command and one report.

    python scripts/gpu_check.py [--parts install,tests,demo,bench] [--budget-s 1200] [--allow-cpu]

The machine has torch, transformers, peft and the other runtime libraries but no network: the wheels it
lacks come from .whl/ (`make gpu-wheels` fetches them here) and go into a directory of their own
(``--site``, /tmp/dapo-gpu-site), never into the machine's environment, so its torch is untouched;
dapo itself runs from src/ (PYTHONPATH). A wheel is installed only where the machine's own copy of that
distribution is missing or older.

Parts, each with its own time limit inside the whole budget (20 minutes by default):
  install  the wheels, then one import of everything the run needs; the versions found
  tests    tests/test_gpu.py, test_gpu_paths.py, test_gpu_teacher.py by item (a-g, i, m-o, t: docstrings) with
           DAPO_GPU_CHECK=1, and every other test marked gpu (tests/test_parallel.py, tests/test_vllm.py: those need
           2 GPUs or vLLM and say so)
  demo     item h: `dapo demo model.device=cuda`; held-out accuracy must rise by at least 15 points; item k:
           the tool demo's settings (configs/demo_tools.yaml: multi-turn rollouts with the Python tool; without
           bubblewrap on the machine, tools.sandbox=none); item l: the demo with rollout.max_staleness=1 (the engine
           in a process of its own, collecting ahead; docs/async.md); item s: with screening (algo.screen_samples)
  bench    benchmarks/gpu.py (the figures for benchmarks/RESULTS.md)
  real     item r, not run by default: SmolLM2-135M-Instruct, its GGUF carried in pieces over several calls
           (`make gpu-model`), imported, given by its Hub id from a cache made on the machine (offline), trained on
           CUDA for 4 minutes, held-out before and after
           (scripts/gpu_check_real.py says how)

Results accumulate in runs/gpu_check/state.json, so the parts can run as separate commands (a device
lent 10 minutes per command: `--parts install,tests`, then `--parts demo,bench`); each command rewrites
the whole report from it: runs/gpu_check/gpu_report.md, and $OUT/gpu_report.md when OUT is set.
Without a CUDA device it stops, unless --allow-cpu (or GPU_CHECK_ALLOW_CPU=1): then the CUDA cases are
reported as skipped, the CPU twins run, the demo is shortened by GPU_CHECK_DEMO_ARGS if given, and the
benchmarks run with --smoke; that checks this script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_real  # noqa: E402
from gpu_check_report import GPU_TEST_FILES, ITEMS, OTHER_GPU_TESTS, now, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = ROOT / "runs" / "gpu_check"
PARTS = ("install", "tests", "demo", "bench", "real")  # real: item r, not in the default (scripts/gpu_check_real.py)
STOP_GRACE_S = 120  # after a SIGTERM, the time a run has to write its checkpoint and exit

# item l: generation ahead of training (docs/async.md)
ASYNC = ["rollout.max_staleness=1", "algo.rollout_is_cap=2"]
# configs/demo_tools.yaml as overrides of `dapo demo` (item k)
DEMO_TOOLS = [
    "model.path=assets/arith-tools-base",
    "rollout.max_response_tokens=64",
    "tools.python=true",
    "tools.max_turns=2",
    "tools.max_calls=1",
    "train.lr=5e-4",
]


def run_with_limit(cmd: list[str], limit: float, log: Path, env: dict | None, stop: int = signal.SIGKILL):
    """(exit code, output, seconds) of ``cmd``; the output also goes to ``log``. It runs in a session of its own,
    so at ``limit`` seconds ``stop`` reaches all of it (torchrun's workers, the grading pool), not only the process
    started here. SIGKILL gives None as the exit code; any other signal (SIGTERM: a dapo run checkpoints and exits
    75) waits up to STOP_GRACE_S for the command's own exit code, then kills it."""
    t0 = time.monotonic()
    with open(log, "w+") as out_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out_file, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, stop)
            try:
                code = None if stop == signal.SIGKILL else proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = None
            proc.wait()
            out_file.write(f"\n[gpu-check: stopped by {signal.Signals(stop).name} after {limit:.0f} s]\n")
        out_file.seek(0)
        out = out_file.read()
    return code, out, time.monotonic() - t0


class Check:
    def __init__(self, args):
        self.args = args
        self.site = Path(args.site)
        self.deadline = time.monotonic() + args.budget_s
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_file = STATE_DIR / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() and not args.fresh else {}

    def save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=1))

    def env(self, **extra) -> dict:
        path = [str(self.site), str(ROOT / "src"), str(ROOT / "tests")]
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
            "DAPO_GPU_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def limit(self, own: float) -> float:
        """A part's time limit: its own, cut to what is left of the whole budget."""
        return max(5.0, min(own, self.deadline - time.monotonic()))

    def run(self, cmd: list[str], timeout: float, log: Path, stop: int = signal.SIGKILL, **env):
        """``run_with_limit`` in this check's environment, its limit cut to what is left of the whole budget."""
        return run_with_limit(cmd, self.limit(timeout), log, self.env(**env), stop=stop)

    # ---- install ----------------------------------------------------------------------------------
    def part_install(self) -> None:
        from importlib.metadata import PackageNotFoundError, version

        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        installed, kept = [], []
        todo = []
        for wheel in wheels:
            name, wanted = wheel.name.split("-")[:2]
            try:
                have = version(name)
            except PackageNotFoundError:
                have = None
            if have is not None and not older(have, wanted) and not self.args.force_wheels:
                kept.append(f"{name} {have} (the machine's)")
                continue
            todo.append(wheel)
            installed.append(f"{name} {wanted}" + (f" (over the machine's {have})" if have else ""))
        self.site.mkdir(parents=True, exist_ok=True)
        how = "none needed"
        if todo:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-deps",
                "--upgrade",
                "--target",
                str(self.site),
                *map(str, todo),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            how = "pip install --no-index --no-deps --target"
            if proc.returncode != 0:  # no pip on the machine: every wheel here is pure Python, a zip to unpack
                for wheel in todo:
                    with zipfile.ZipFile(wheel) as z:
                        z.extractall(self.site)
                how = f"unzipped (pip failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]})"
        probe = (
            "import json, platform, torch, transformers, peft, math_verify, pytest, pytest_timeout, dapo\n"
            "from importlib.metadata import version\n"
            "cuda = torch.cuda.is_available()\n"
            "p = torch.cuda.get_device_properties(0) if cuda else None\n"
            "nccl = '.'.join(map(str, torch.cuda.nccl.version())) if cuda else None\n"
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,\n"
            " 'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), 'nccl': nccl,\n"
            " 'device': torch.cuda.get_device_name(0) if cuda else None, 'devices': torch.cuda.device_count(),\n"
            " 'memory_gib': round(p.total_memory / 2**30, 1) if p else None,\n"
            " 'capability': f'{p.major}.{p.minor}' if p else None,\n"
            " 'transformers': transformers.__version__, 'peft': peft.__version__,\n"
            " 'math_verify': version('math-verify'), 'pytest': pytest.__version__,\n"
            " 'tf32_matmul': torch.backends.cuda.matmul.allow_tf32}))\n"
        )
        code, out, _ = self.run([sys.executable, "-c", probe], 120, STATE_DIR / "install.log")
        env = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
        self.state["install"] = {
            "ok": code == 0,
            "installed": installed,
            "kept": kept,
            "how": how,
            "env": env,
            "error": None if code == 0 else out[-2000:],
            "at": now(),
        }
        if code != 0:
            raise SystemExit(f"gpu-check: the environment does not import:\n{out[-2000:]}")

    # ---- tests ------------------------------------------------------------------------------------
    def pytest(self, name: str, selection: list[str], timeout: float) -> dict:
        junit = STATE_DIR / f"junit_{name}.xml"
        junit.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "--timeout",
            str(int(timeout)),
            *selection,
        ]
        code, out, seconds = self.run(cmd, timeout + 30, STATE_DIR / f"pytest_{name}.log")
        cases = parse_junit(junit) if junit.exists() else []
        figures = [line[len("GPU-CHECK ") :] for line in out.splitlines() if line.startswith("GPU-CHECK ")]
        return {
            "exit": code,
            "seconds": round(seconds, 1),
            "cases": cases,
            "figures": figures,
            "tail": "" if code == 0 else out[-4000:],
        }

    def part_tests(self) -> None:
        results = self.state.setdefault("tests", {})
        chosen = [i for i in os.environ.get("GPU_CHECK_ITEMS", "").split(",") if i]  # a rerun of a few items
        if unknown := sorted(set(chosen) - set(ITEMS) - {"gpu-marked"}):
            sys.exit(f"GPU_CHECK_ITEMS: unknown {unknown}; choose from {','.join([*ITEMS, 'gpu-marked'])}")
        for item, (_, selection, timeout) in ITEMS.items():
            if chosen and item not in chosen:
                continue
            print(f"gpu-check: item {item} ...", flush=True)
            results[item] = self.pytest(item, [*GPU_TEST_FILES, "-k", selection], timeout)
            self.save()
        if chosen and "gpu-marked" not in chosen:
            return
        print("gpu-check: other tests marked gpu ...", flush=True)
        results["gpu-marked"] = self.pytest("gpu_marked", ["-m", "gpu", *OTHER_GPU_TESTS], 120)
        self.save()

    # ---- demo -------------------------------------------------------------------------------------
    def part_demo(self) -> None:
        """Item h, the demo on CUDA; then item k, with the Python tool (configs/demo_tools.yaml's settings as
        overrides of the demo), item l, with the engine collecting ahead (rollout.max_staleness=1), and item s, with
        screening (algo.screen_samples)."""
        import shutil

        tools = [*DEMO_TOOLS, *([] if shutil.which("bwrap") else ["tools.sandbox=none"])]
        demos = {"demo": [], "demo_tools": tools, "demo_async": ASYNC}
        demos["demo_screening"] = ["algo.screen_samples=4", "algo.screen_audit=0.1"]  # item s: G = 8, n = G/2
        chosen = [d for d in os.environ.get("GPU_CHECK_DEMOS", "").split(",") if d]  # a rerun of a few demos
        if unknown := sorted(set(chosen) - set(demos)):
            sys.exit(f"GPU_CHECK_DEMOS: unknown {unknown}; choose from {','.join(demos)}")
        for key, extra in demos.items():
            if chosen and key not in chosen:
                continue
            self.state[key] = self.demo(key, extra)
            self.save()

    def demo(self, key: str, extra: list[str]) -> dict:
        cuda = (self.state.get("install", {}).get("env") or {}).get("device") is not None
        run_dir = STATE_DIR / key
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # a finished demo would only be reported again
        shorten = os.environ.get("GPU_CHECK_DEMO_ARGS", "").split()
        cmd = [
            sys.executable,
            "-m",
            "dapo.cli",
            "demo",
            f"model.device={'cuda' if cuda else 'cpu'}",
            f"run.dir={run_dir}",
            "run.progress=false",
            *extra,
            *shorten,
        ]
        code, out, seconds = self.run(cmd, 420, STATE_DIR / f"{key}.log", COLUMNS="200")
        m = re.search(
            r"held-out accuracy: \S+ (avg@\d+) ([\d.]+)% \[[^\]]*\] before -> ([\d.]+)% \[[^\]]*\] after step (\d+)",
            out,
        )
        wall = re.search(r"wall time: ([\d.]+) s", out)
        generation = re.search(r"^generation: (.*)$", out, flags=re.M)
        found = {
            "exit": code,
            "seconds": round(seconds, 1),
            "command": " ".join(cmd[2:]),
            "cuda": cuda,
            "shortened": bool(shorten),
            "generation": generation.group(1) if generation else None,
            "tail": "" if code == 0 and m else out[-3000:],
        }
        if m:
            before, after = float(m.group(2)), float(m.group(3))
            found |= {
                "metric": m.group(1),
                "before": before,
                "after": after,
                "steps": int(m.group(4)),
                "rise": round(after - before, 1),
                "wall_s": float(wall.group(1)) if wall else None,
            }
        return found

    def part_real(self) -> None:
        self.state["real"] = gpu_check_real.part_real(self, STATE_DIR)
        self.save()

    # ---- bench ------------------------------------------------------------------------------------
    def part_bench(self) -> None:
        cuda = (self.state.get("install", {}).get("env") or {}).get("device") is not None
        out_json = STATE_DIR / "bench.json"
        out_json.unlink(missing_ok=True)
        cmd = [sys.executable, "benchmarks/gpu.py", "--json", str(out_json)] + ([] if cuda else ["--smoke"])
        if parts := os.environ.get("GPU_CHECK_BENCH_PARTS"):
            cmd += ["--parts", parts]
        code, out, seconds = self.run(cmd, 480, STATE_DIR / "bench.log")
        data = json.loads(out_json.read_text()) if out_json.exists() else {}
        new = {
            "exit": code,
            "seconds": round(seconds, 1),
            "smoke": not cuda,
            **data,
            "tail": "" if code == 0 else out[-4000:],
        }
        self.state["bench"] = merge_bench(self.state.get("bench"), new)
        self.save()


def merge_bench(old: dict | None, new: dict) -> dict:
    """The figures of a bench run over those of an earlier one on the same device: a part run again replaces
    its rows, the parts not run again keep theirs. So a bench cut short by its time limit goes on with
    GPU_CHECK_BENCH_PARTS=<the parts left> without losing what it measured."""
    same = old and old.get("smoke") == new.get("smoke") and old.get("header", [""])[:1] == new.get("header", [""])[:1]
    if (
        not same or not isinstance(old.get("rows"), dict) or not isinstance(new.get("rows"), dict)
    ):  # (or one cut before its JSON)
        return new
    redone = set(new.get("done", []))

    def kept(by_part: dict) -> dict:
        return {k: v for k, v in by_part.items() if k not in redone}

    return {
        **new,
        "rows": kept(old["rows"]) | new["rows"],
        "results": {**old.get("results", {}), **new.get("results", {})},
        "failed": kept(old.get("failed", {})) | new.get("failed", {}),
        "done": [part for part in new["all_parts"] if part in redone or part in old.get("done", [])],
    }


def older(have: str, wanted: str) -> bool:
    """Whether version ``have`` is below ``wanted`` (numeric parts compared; a pre-release counts as its release)."""

    def key(v: str) -> tuple:
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:4])

    return key(have) < key(wanted)


def parse_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "failed", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:300]
                break
        name = case.get("name", "")
        device = "cuda" if "cuda" in name else "cpu" if "cpu" in name else ("cuda" if "gpu" in name else "other")
        cases.append(
            {
                "name": name,
                "status": status,
                "device": device,
                "message": message,
                "seconds": float(case.get("time", 0)),
            }
        )
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ",".join(PARTS))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("GPU_CHECK_BUDGET_S", 1200)),
        help="the whole command's time (default 1200 s; each part also has its own limit)",
    )
    ap.add_argument(
        "--site",
        default=os.environ.get("GPU_CHECK_SITE", "/tmp/dapo-gpu-site"),
        help="where the wheels are installed (not the machine's environment)",
    )
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        default=os.environ.get("GPU_CHECK_ALLOW_CPU") == "1",
        help="run without a CUDA device (checks this script; CUDA cases skipped)",
    )
    ap.add_argument("--fresh", action="store_true", help="forget the results of earlier commands")
    ap.add_argument(
        "--force-wheels",
        action="store_true",
        default=os.environ.get("GPU_CHECK_FORCE_WHEELS") == "1",
        help="install every wheel of .whl even where the machine has it (to check the install itself)",
    )
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        sys.exit(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    check = Check(args)
    if carried := gpu_check_real.stash(ROOT, STATE_DIR / "model"):  # item r's model pieces, kept between calls
        print(f"gpu-check: kept the model pieces {', '.join(carried)} in {STATE_DIR / 'model'}", flush=True)
    if "install" in parts or "install" not in check.state:
        check.part_install()
        check.save()
    if not (check.state["install"]["env"] or {}).get("device") and not args.allow_cpu:
        sys.exit(
            "gpu-check: no CUDA device is visible; this checks the GPU paths (GPU_CHECK_ALLOW_CPU=1 runs it "
            "on the CPU to check the script itself)"
        )
    for part in parts:
        if part == "install":
            continue
        if check.deadline - time.monotonic() < 10:
            print(f"gpu-check: budget spent; {part} not run", flush=True)
            continue
        t0 = time.monotonic()
        print(f"gpu-check: {part} ...", flush=True)
        getattr(check, f"part_{part}")()
        print(f"gpu-check: {part} done in {time.monotonic() - t0:.0f} s", flush=True)
    paths = [STATE_DIR / "gpu_report.md"] + (
        [Path(os.environ["OUT"]) / "gpu_report.md"] if os.environ.get("OUT") else []
    )
    text = write_report(check.state, paths)
    if os.environ.get("OUT"):  # the logs beside the report, for what the report's tails do not show
        import shutil

        keep = Path(os.environ["OUT"]) / "gpu_check"
        keep.mkdir(parents=True, exist_ok=True)
        for f in [*STATE_DIR.glob("*.log"), *STATE_DIR.glob("*.json")]:
            shutil.copy(f, keep / f.name)
    print(text)
    print(f"report: {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
