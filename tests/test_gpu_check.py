"""scripts/gpu_check.py's own logic (what `make gpu-check` installs, how it reads pytest's results and the demo's
last line, what it reports), without a GPU; the whole script runs on a CPU with GPU_CHECK_ALLOW_CPU=1."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
report = sys.modules["gpu_check_report"]  # imported by gpu_check from scripts/


@pytest.mark.parametrize(
    "have,wanted,older",
    [
        ("2.3.1", "2.3.1", False),
        ("23.2", "26.3", True),
        ("1.13.3", "1.14.0", True),
        ("2.21.0", "2.7.2", False),
        ("4.13.2", "4.13.2", False),
        ("2.11.0+cu130", "2.11.0", False),
        ("1.6.0", "1.7.0", True),
    ],
)
def test_a_wheel_goes_in_only_over_an_older_copy(have, wanted, older):
    assert gpu_check.older(have, wanted) is older


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_x[float32-cpu]" time="1.5"/>
<testcase classname="tests.test_gpu" name="test_x[float32-cuda]" time="2.0">
<failure message="assert 0.3 &lt;= 0.02">...</failure></testcase>
<testcase classname="tests.test_gpu" name="test_y[cuda]" time="0.0"><skipped message="needs a CUDA device"/></testcase>
<testcase classname="tests.test_gpu" name="test_two_steps_on_gpu[bfloat16]" time="3.0"/>
</testsuite></testsuites>"""


def test_cases_are_read_by_device_and_an_item_fails_on_any_failure(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    cases = gpu_check.parse_junit(tmp_path / "j.xml")
    assert [(c["device"], c["status"]) for c in cases] == [
        ("cpu", "passed"),
        ("cuda", "failed"),
        ("cuda", "skipped"),
        ("cuda", "passed"),
    ]
    assert cases[1]["message"] == "assert 0.3 <= 0.02"
    verdict, detail = report.item_status({"exit": 1, "seconds": 9, "cases": cases})
    assert verdict == "FAIL" and detail == "cuda: 1 passed, 1 failed, 1 skipped, cpu: 1 passed, 0 failed, 0 skipped"


def test_an_item_passes_only_where_its_cuda_cases_ran():
    def case(device, status):
        return {"device": device, "status": status}

    status = lambda *cases, code=0: report.item_status({"exit": code, "seconds": 1, "cases": list(cases)})[0]  # noqa: E731
    assert status(case("cuda", "passed"), case("cpu", "passed")) == "PASS"
    assert status(case("cuda", "passed"), case("cuda", "skipped")) == "PASS (some CUDA cases skipped)"
    assert status(case("cuda", "skipped"), case("cpu", "passed")) == "SKIPPED on CUDA (cpu twins only)"
    assert status(code=2) == "FAIL"  # pytest stopped before any case (a collection error)
    assert report.item_status({"exit": None, "seconds": 240, "cases": []})[0] == "FAIL (time-out)"
    assert report.item_status(None)[0] == "NOT RUN"


def test_the_report_says_plainly_when_no_gpu_was_there(tmp_path):
    state = {
        "install": {"env": {"device": None, "python": "3.12"}, "installed": [], "kept": [], "how": "none needed"},
        "demo": {
            "exit": 0,
            "seconds": 100,
            "command": "dapo.cli demo model.device=cpu",
            "cuda": False,
            "shortened": True,
            "metric": "avg@4",
            "before": 21.9,
            "after": 37.5,
            "steps": 4,
            "rise": 15.6,
            "wall_s": 99.0,
            "tail": "",
        },
    }
    text = report.write_report(state, [tmp_path / "r.md"])
    assert (tmp_path / "r.md").read_text() == text
    assert "no CUDA device was visible" in text and "no figure below is a GPU figure" in text
    assert "| h | `dapo.cli demo model.device=cpu`" in text and "CPU run (shortened): rose 15.6 points" in text
    assert "| a | " in text and "NOT RUN" in text  # the tests part never ran in this state
    assert "| s | `dapo demo model.device=cuda`: with algo.screen_samples=4" in text  # nor screening's demo
    state["demo_screening"] = state["demo"] | {
        "command": "dapo.cli demo model.device=cpu algo.screen_samples=4",
        "generation": "1.21 tokens generated per token trained; 9 s of 40 s generating went to dropped groups (22%)",
    }
    text = report.write_report(state, [])
    assert "| s | `dapo.cli demo model.device=cpu algo.screen_samples=4`: with algo.screen_samples=4" in text
    assert "; 1.21 tokens generated per token trained" in text
    state["install"]["env"] |= {
        "device": "NVIDIA H100 80GB HBM3",
        "devices": 1,
        "memory_gib": 79.1,
        "capability": "9.0",
    }
    state["demo"] |= {"cuda": True, "shortened": False, "rise": 12.0}
    text = report.write_report(state, [])
    assert "**device: NVIDIA H100 80GB HBM3**" in text and "FAIL (rose 12.0 points)" in text


def test_the_report_names_the_commit_given_where_the_copy_has_no_git(tmp_path, monkeypatch):
    state = {"install": {"env": {"device": None}, "installed": [], "kept": [], "how": "none needed"}}
    # a copy of the tree without .git, as a lent machine gets
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    assert ", commit ?" in report.write_report(state, [])
    monkeypatch.setenv("GPU_CHECK_COMMIT", "94e06aa")
    assert ", commit 94e06aa" in report.write_report(state, [])


def test_a_bench_cut_short_keeps_its_figures_and_a_rerun_of_the_rest_adds_to_them(tmp_path):
    """benchmarks/gpu.py writes its JSON after every part; gpu-check merges a rerun of some parts into the
    earlier rows (same device), and the report names the parts still unmeasured with the command for them."""
    import json
    import subprocess
    import sys

    out = tmp_path / "b.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--smoke", "--parts", "peak,rollout", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    first = json.loads(out.read_text())
    assert first["done"] == ["peak", "rollout"] and first["all_parts"][0] == "peak"
    assert [len(first["rows"][p]) for p in ("peak", "rollout")] == [1, 1]
    assert first["rows"]["rollout"][0].startswith("| HF generate rollout")

    # as stopped by the time limit during "update": peak done, nothing of update saved
    cut = {
        **first,
        "exit": None,
        "seconds": 480.0,
        "smoke": True,
        "done": ["peak"],
        "tail": "...",
        "rows": {"peak": first["rows"]["peak"]},
    }
    state = {"install": {"env": {"device": None}, "installed": [], "kept": [], "how": "none needed"}, "bench": cut}
    text = report.write_report(state, [])
    left = [p for p in first["all_parts"] if p != "peak"]
    assert f"GPU_CHECK_BENCH_PARTS={','.join(left)}`" in text and "(stopped after 480.0 s)" in text
    assert first["rows"]["peak"][0] in text and first["rows"]["rollout"][0] not in text

    rerun = {
        **first,
        "exit": 0,
        "seconds": 20.0,
        "smoke": True,
        "done": ["rollout"],
        "tail": "",
        "rows": {"rollout": first["rows"]["rollout"]},
        "failed": {"rollout": "x"},
    }
    merged = gpu_check.merge_bench(cut, rerun)
    assert merged["rows"] == {"peak": first["rows"]["peak"], "rollout": first["rows"]["rollout"]}
    text = report.write_report({**state, "bench": merged}, [])
    assert text.index(first["rows"]["peak"][0]) < text.index(first["rows"]["rollout"][0])
    assert merged["done"] == ["peak", "rollout"] and merged["failed"] == {"rollout": "x"}
    assert "peak" in merged["results"] and merged["exit"] == 0
    # another device (or a smoke run over GPU figures): nothing is merged
    assert gpu_check.merge_bench({**cut, "smoke": False}, rerun) is rerun
    # a run stopped before it wrote any JSON, or a state of an older layout: the new run stands alone
    assert gpu_check.merge_bench(cut, {"exit": None, "seconds": 480.0, "smoke": True}) == {
        "exit": None,
        "seconds": 480.0,
        "smoke": True,
    }
    assert gpu_check.merge_bench({**cut, "rows": ["| a | b | c |"]}, rerun) is rerun


def test_the_demo_part_runs_the_demo_then_the_others_and_reads_their_lines(tmp_path, monkeypatch):
    """Items h, k, l and s without running them: the two commands the part starts, and what it reads from their output
    (the held-out line, the wall time and the generation line of the run summary)."""
    import types

    monkeypatch.setattr(gpu_check, "STATE_DIR", tmp_path)
    args = types.SimpleNamespace(site=str(tmp_path / "site"), budget_s=60, fresh=True)
    check = gpu_check.Check(args)
    env = {"device": "NVIDIA H200", "devices": 1, "memory_gib": 139.8, "capability": "9.0", "python": "3.12"}
    check.state = {"install": {"env": env, "installed": [], "kept": [], "how": "none needed"}}
    started = []

    def fake_run(cmd, timeout, log, **env):
        started.append(cmd[3:])  # after python -m dapo.cli
        out = (
            "held-out accuracy: arith avg@4 28.7% [25.1, 32.2] before -> 72.8% [68.9, 76.4] after step 60  (95% CI)\n"
            "wall time: 29 s\n"
            "generation: 1.52 tokens generated per token trained; 9 s of 30 s generating went to dropped groups (30%)"
            + (
                "; screening dropped 700 of 900 prompts after their first responses"
                if "algo.screen_samples=4" in cmd
                else ""
            )
        )
        return 0, out, 35.0

    check.run = fake_run
    check.part_demo()
    assert [c[:2] for c in started] == [["demo", "model.device=cuda"]] * 4
    assert "tools.python=true" in started[1] and "model.path=assets/arith-tools-base" in started[1]
    assert "rollout.max_staleness=1" in started[2] and "rollout.max_staleness=1" not in started[0]
    assert "algo.screen_samples=4" in started[3] and "algo.screen_samples=4" not in started[0]
    h, s = check.state["demo"], check.state["demo_screening"]
    assert (h["before"], h["after"], h["rise"], h["wall_s"], h["tail"]) == (28.7, 72.8, 44.1, 29.0, "")
    assert s["generation"].endswith("screening dropped 700 of 900 prompts after their first responses")
    text = report.write_report(check.state, [])
    assert "| s | `dapo.cli demo model.device=cuda" in text and "| PASS |" in text
    assert "| l | `dapo.cli demo model.device=cuda" in text and "rollout.max_staleness=1" in text


def test_the_tool_demos_overrides_are_configs_demo_tools():
    from dataclasses import replace

    from dapo.config import load_config

    as_overrides = load_config("configs/demo.yaml", gpu_check.DEMO_TOOLS)
    preset = load_config("configs/demo_tools.yaml")
    assert replace(as_overrides, run=preset.run) == preset


def test_the_real_models_pieces_wait_until_all_came_then_join_to_the_checked_file(tmp_path):
    """Item r's GGUF crosses in pieces: each call keeps what it carried; a missing or damaged piece is named."""
    real = gpu_check.gpu_check_real
    src = tmp_path / "m.gguf"
    src.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    tree, stash = tmp_path / "tree", tmp_path / "stash"
    made = real.split(src, tree / real.PIECES_DIR, [4000, 4000, 2240])
    assert [p["size"] for p in made["pieces"]] == [4000, 4000, 2240]
    pieces = sorted((tree / real.PIECES_DIR).glob("m.gguf.*"))
    pieces[1].rename(tmp_path / "held back")  # the first call carries pieces 1 and 3
    assert real.stash(tree, stash) == ["m.gguf.001", "m.gguf.003"]
    assert real.assemble(stash) == (None, "waiting for 1 of 3 pieces: m.gguf.002")
    (tmp_path / "held back").rename(pieces[1])
    (stash / "m.gguf.001").write_bytes(b"x" * 4000)  # damaged on the way
    assert real.stash(tree, stash) == ["m.gguf.001", "m.gguf.002", "m.gguf.003"]
    (stash / "m.gguf.003").write_bytes(b"y" * 2240)
    assert real.assemble(stash) == (None, "piece m.gguf.003 is damaged (sha256 differs): carry it again")
    real.stash(tree, stash)
    whole, how = real.assemble(stash)
    assert whole.read_bytes() == src.read_bytes() and how == "joined from 3 pieces, sha256 checked"


def test_the_real_model_item_imports_trains_until_its_time_then_evaluates_and_reports(tmp_path, monkeypatch):
    """Item r without a GPU or the model: the commands it starts, the stop at its time, what it reads back."""
    import json
    import signal
    import types

    real = gpu_check.gpu_check_real
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "manifest.json").write_text(json.dumps({"file": "m.gguf", "size": 3, "pieces": []}))
    (tmp_path / "model" / "m.gguf").write_bytes(b"abc")
    check = types.SimpleNamespace(state={"install": {"env": {"device": "NVIDIA H100"}}}, env=lambda: {})
    started = []

    def fake_run(cmd, timeout, log, stop=None, **env):
        started.append(cmd[3])
        if cmd[3] == "import-model":  # the imported directory (two of its files)
            Path(cmd[5]).mkdir(parents=True)
            (Path(cmd[5]) / "config.json").write_text('{"model_type": "llama"}')
            (Path(cmd[5]) / "model.safetensors").write_bytes(b"weights")
        if cmd[3] in ("train", "eval"):  # the model by its Hub id, from a cache made on the machine, offline
            assert env["HF_HUB_OFFLINE"] == "1" and Path(env["HF_HUB_CACHE"]).is_dir()
        if cmd[3] == "eval":
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "eval.json").write_text(json.dumps({"word": {"avg": 0.4125}}))
        if cmd[3] == "train":  # stopped by SIGTERM at its time: the run checkpoints and exits 75
            assert (timeout, stop) == (240, signal.SIGTERM)
            assert "model.device=cuda" in cmd and "rollout.backend=hf" in cmd
            assert f"model.path={real.HUB_ID}" in cmd
            repo = Path(env["HF_HUB_CACHE"]) / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
            snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
            assert (snapshot / "config.json").read_text() == '{"model_type": "llama"}'  # a link to its blob
            run_dir = Path(next(a for a in cmd if a.startswith("run.dir=")).split("=", 1)[1]) / "real_run"
            run_dir.mkdir(parents=True)
            rows = [{"step": 0, "eval/word/avg@4": 0.3}] + [
                {"step": t, "rollout/acc_mean": a} for t, a in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1)
            ]
            (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
            return 75, "preempted: checkpoint of step 6", 240.0
        return 0, "", 1.0

    check.run = fake_run
    found = real.part_real(check, tmp_path)
    assert started == ["import-model", "train", "eval"]
    assert (found["steps"], found["before"], found["after"]) == (6, 30.0, 41.2)
    assert (found["train_acc_first"], found["train_acc_last"]) == (20.0, 50.0)
    line = real.report_line(found)
    assert "| PASS | 6 steps in" in line and "held-out avg@n 30.0% -> 41.2%" in line


def test_the_real_models_training_is_stopped_with_sigterm_at_its_time(tmp_path):
    """The run gets SIGTERM (on which dapo checkpoints and exits 75), not a kill, when its time is up; the other
    checks are killed outright."""
    import signal
    import sys

    on_term = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); "
    on_term += "print('up', flush=True); time.sleep(60)"
    cmd = [sys.executable, "-c", on_term]
    code, out, seconds = gpu_check.run_with_limit(cmd, 2, tmp_path / "log", None, stop=signal.SIGTERM)
    assert (code, out) == (75, "up\n\n[gpu-check: stopped by SIGTERM after 2 s]\n") and seconds < 30
    code, out, _ = gpu_check.run_with_limit(cmd, 2, tmp_path / "log", None)
    assert (code, out) == (None, "up\n\n[gpu-check: stopped by SIGKILL after 2 s]\n")


def test_the_model_is_cut_into_the_fewest_pieces_that_fit_beside_the_tree():
    """Each call carries the working tree, the manifest and one piece within the call's limit; the first call
    also carries the wheels."""
    real = gpu_check.gpu_check_real
    limit = real.CALL_MARGIN + 1000 + 4000  # 4,000 bytes of room beside a 1,000-byte tree
    assert real.piece_sizes(10_240, 1000, 1500, limit) == [2500, 4000, 3740]
    assert real.piece_sizes(2000, 1000, 1500, limit) == [2000]
    with pytest.raises(SystemExit, match="leaves no room"):
        real.piece_sizes(10_240, 1000, 4000, limit)


def test_a_lease_carries_a_piece_a_call_and_runs_item_r_with_the_last(tmp_path):
    real = gpu_check.gpu_check_real
    manifest = {"pieces": [{"name": f"m.gguf.00{k}"} for k in (1, 2, 3, 4)]}
    plan = real.lease_plan(manifest, [tmp_path / "a-1.whl"], "abc1234")
    calls = plan.split("\n\n")[2:]
    assert len(calls) == 6 and plan.startswith("# One lease, 6 calls, at commit abc1234")
    assert '[".whl/a-1.whl", ".gpu_model/manifest.json", ".gpu_model/m.gguf.001"]' in calls[0]
    assert '".gpu_model/m.gguf.003"' in calls[2] and "GPU_CHECK_PARTS=real GPU_CHECK_BUDGET_S=40" in calls[2]
    assert '".gpu_model/m.gguf.004"' in calls[3] and calls[3].startswith("4. item r")
    assert "carry: []" in calls[4] and "GPU_CHECK_BENCH_PARTS=peak,kernels" in calls[4]
    assert all("command: GPU_CHECK_COMMIT=abc1234 " in call for call in calls)


def test_the_tree_that_travels_is_tracked_and_unignored_files(tmp_path):
    import subprocess

    real = gpu_check.gpu_check_real
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("big/\n")  # 5 bytes
    (tmp_path / "tracked.txt").write_bytes(b"x" * 100)
    (tmp_path / "new.txt").write_bytes(b"y" * 20)  # untracked, not ignored: it travels
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "w.bin").write_bytes(b"z" * 10_000)  # ignored: only carried when named
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    assert real.tree_bytes(tmp_path) == 125


def test_a_bench_part_stopped_midway_keeps_the_rows_it_printed(tmp_path, monkeypatch):
    """The JSON is written after every row too: a kernels part stopped by the time limit after its first variant
    keeps that row (the goal's 1.5B shape comes first), and ``done`` does not count the part, so the report asks
    for it again."""
    import json

    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    calls = []

    def fake_rate(self, name, overrides, **kw):  # eager 1.5B, compile 1.5B, then the time limit
        calls.append((name, overrides))
        if len(calls) == 3:
            raise SystemExit("stopped by the time limit")
        seconds = 2.0 if not overrides else 1.6
        quiet = {"mean": 1.0, "own_jobs": 1, "foreign_frac": 0.0, "clean": True}  # no other work beside it
        rate = {"tokens_per_s": 1000 / seconds, "seconds": seconds, "mfu": 0.8 / seconds, "peak_gib": None}
        return rate | {"cpu_s": seconds, "load": quiet}

    monkeypatch.setattr(gpu.Bench, "update_rate", fake_rate)
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--smoke", "--parts", "peak,kernels", "--json", str(out)])
    with pytest.raises(SystemExit, match="time limit"):
        gpu.main()
    saved = json.loads(out.read_text())
    assert calls[:2] == [("qwen2.5-1.5b", []), ("qwen2.5-1.5b", ["train.kernels=[compile]"])]
    assert saved["done"] == ["peak"] and len(saved["rows"]["kernels"]) == 1
    row = saved["rows"]["kernels"][0]
    assert row.startswith(
        "| update, qwen2.5-1.5b shape, train.kernels compile | 625 tokens/s, MFU 50% (eager 40%): 1.25x"
    )
    state = {"install": {"env": {"device": None}, "installed": [], "kept": [], "how": "none needed"}}
    text = report.write_report({**state, "bench": {**saved, "exit": None, "seconds": 300.0, "smoke": True}}, [])
    assert row in text and "GPU_CHECK_BENCH_PARTS=update,kernels," in text
