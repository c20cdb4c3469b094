"""make gpu-check's item r: SmolLM2-135M-Instruct, a real pretrained model, learning on the GPU.

The model travels as its GGUF (SmolLM2-135M-Instruct.Q4_1.gguf from `make smollm2`, 98 MB), more than one call to
the lent machine carries beside the working tree (64 MiB in all), so `make gpu-model` cuts it into pieces under
.gpu_model/ with a manifest (each piece's size and sha256, and the whole file's). Every gpu-check command copies
the pieces it was given into runs/gpu_check/model/ (kept between calls while the machine stays warm); once all
are there, part `real` joins them, checks the sha256, imports the model (`dapo import-model`), trains the SmolLM2
preset on its word problems on CUDA for GPU_CHECK_REAL_S seconds (240 by default; then SIGTERM, on which the run
checkpoints its last completed step and exits 75), and evaluates that checkpoint with the preset's held-out
settings (`dapo eval --run`). Reported: the steps trained, held-out avg@n (the preset's n = 4) before (the run's
step-0 evaluation) and after, the train accuracy of the first and the last steps.

    make gpu-model                                                    # here, once: .gpu_model/
    carry .whl .gpu_model/manifest.json .gpu_model/<piece 1>:   GPU_CHECK_PARTS=install,tests make gpu-check
    carry .gpu_model/manifest.json .gpu_model/<piece k> ...:    GPU_CHECK_PARTS=real make gpu-check   (until r runs)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PIECES_DIR = ".gpu_model"  # in the working tree, ignored: what a call carries
PRESET = "configs/smollm2_135m.yaml"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def split(src: Path, out: Path, piece_mb: float) -> dict:
    """``src`` cut into pieces of at most ``piece_mb`` MB in ``out``, beside manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    size, step = src.stat().st_size, int(piece_mb * 1e6)
    pieces = []
    with open(src, "rb") as f:
        for _ in range(0, size, step):
            piece = out / f"{src.name}.{len(pieces) + 1:03d}"
            piece.write_bytes(f.read(step))
            pieces.append({"name": piece.name, "size": piece.stat().st_size, "sha256": sha256(piece)})
    manifest = {"file": src.name, "size": size, "sha256": sha256(src), "pieces": pieces}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stash(root: Path, stash_dir: Path) -> list[str]:
    """Copy the manifest and the pieces this call carried into ``stash_dir``; returns the pieces copied."""
    carried = root / PIECES_DIR
    if not (carried / "manifest.json").exists():
        return []
    stash_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(carried / "manifest.json", stash_dir / "manifest.json")
    manifest = json.loads((carried / "manifest.json").read_text())
    copied = []
    for piece in manifest["pieces"]:
        src = carried / piece["name"]
        if src.exists() and src.stat().st_size == piece["size"]:
            shutil.copy(src, stash_dir / piece["name"])
            copied.append(piece["name"])
    return copied


def assemble(stash_dir: Path) -> tuple[Path | None, str]:
    """The whole GGUF from the stashed pieces, checked; or None and what is missing or wrong."""
    if not (stash_dir / "manifest.json").exists():
        return None, "no manifest: carry .gpu_model/manifest.json (make gpu-model) with the pieces"
    manifest = json.loads((stash_dir / "manifest.json").read_text())
    whole = stash_dir / manifest["file"]
    if whole.exists() and whole.stat().st_size == manifest["size"]:
        return whole, "assembled earlier"
    missing = [p["name"] for p in manifest["pieces"] if not (stash_dir / p["name"]).exists()]
    if missing:
        return None, f"waiting for {len(missing)} of {len(manifest['pieces'])} pieces: {', '.join(missing)}"
    for p in manifest["pieces"]:
        if sha256(stash_dir / p["name"]) != p["sha256"]:
            return None, f"piece {p['name']} is damaged (sha256 differs): carry it again"
    with open(whole, "wb") as out:
        for p in manifest["pieces"]:
            out.write((stash_dir / p["name"]).read_bytes())
    if sha256(whole) != manifest["sha256"]:
        whole.unlink()
        return None, "the joined file's sha256 differs from the manifest's"
    return whole, f"joined from {len(manifest['pieces'])} pieces, sha256 checked"


def train_until(cmd: list[str], seconds: float, log: Path, env: dict, root: Path) -> tuple[int | None, str]:
    """Run ``cmd``; after ``seconds`` send SIGTERM (the run checkpoints and exits 75), SIGKILL 120 s later."""
    with open(log, "w+") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        out.seek(0)
        return code, out.read()


def read_run(run_dir: Path) -> dict:
    """Steps trained, the step-0 held-out accuracy and the train accuracy of the first and last 3 steps."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "rollout/acc_mean" in r]
    before = next((v for r in rows if r.get("step") == 0 for k, v in r.items() if "/avg@" in k), None)
    mean = lambda xs: round(100 * sum(xs) / len(xs), 1) if xs else None  # noqa: E731
    return {
        "steps": max((r["step"] for r in steps), default=0),
        "before": None if before is None else round(100 * before, 1),
        "train_acc_first": mean([r["rollout/acc_mean"] for r in steps[:3]]),
        "train_acc_last": mean([r["rollout/acc_mean"] for r in steps[-3:]]),
    }


def part_real(check, root: Path, state_dir: Path) -> dict:
    """Item r, as described above; ``check`` is gpu_check's Check (its environment, its run with a time limit)."""
    found: dict = {"at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    gguf, how = assemble(state_dir / "model")
    found["model"] = how
    if gguf is None:
        return found
    model_dir = state_dir / "model" / "SmolLM2-135M-Instruct"
    if not (model_dir / "config.json").exists():
        code, out, _ = check.run(
            [sys.executable, "-m", "dapo.cli", "import-model", str(gguf), str(model_dir)], 300, state_dir / "real.log"
        )
        if code != 0:
            return found | {"error": f"import-model failed: {out[-1500:]}"}
    cuda = (check.state.get("install", {}).get("env") or {}).get("device") is not None
    run_dir = state_dir / "real_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.path={model_dir}", f"model.device={'cuda' if cuda else 'cpu'}", "rollout.backend=hf"]
    overrides += ["train.total_steps=1000", "eval.every_steps=null", "eval.before_train=true", "run.save_every=null"]
    overrides += [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", "run.progress=false"]
    overrides += os.environ.get("GPU_CHECK_REAL_ARGS", "").split()
    seconds = float(os.environ.get("GPU_CHECK_REAL_S", 240))
    cmd = [sys.executable, "-m", "dapo.cli", "train", PRESET, *overrides]
    t0 = time.monotonic()
    code, out = train_until(cmd, seconds, state_dir / "real_train.log", check.env(), root)
    found |= {"cuda": cuda, "command": " ".join(cmd[2:]), "train_exit": code, "train_s": round(time.monotonic() - t0)}
    if code not in (0, 75) or not (run_dir / "metrics.jsonl").exists():
        return found | {"error": f"training failed: {out[-2000:]}"}
    found |= read_run(run_dir)
    out_dir = state_dir / "real_eval"
    shutil.rmtree(out_dir, ignore_errors=True)
    eval_cmd = [sys.executable, "-m", "dapo.cli", "eval", "--run", str(run_dir), "--out", str(out_dir)]
    code, out, _ = check.run(eval_cmd, 300, state_dir / "real_eval.log")
    if code != 0 or not (out_dir / "eval.json").exists():
        return found | {"error": f"evaluation failed: {out[-2000:]}"}
    result = next(iter(json.loads((out_dir / "eval.json").read_text()).values()))
    return found | {"after": round(100 * result["avg"], 1)}


def report_line(found: dict | None) -> str:
    what = "SmolLM2-135M-Instruct (GGUF carried in pieces) trained on its word problems, held-out before and after"
    if found is None:
        return f"| r | {what} | NOT RUN | |"
    if "after" not in found:
        return f"| r | {what} | {'FAIL' if 'error' in found else 'WAITING'} | {found.get('error', found['model'])} |"
    verdict = ("PASS" if found["after"] > found["before"] else "RAN (no rise)") if found["cuda"] else "CPU run"
    return (
        f"| r | {what} | {verdict} | {found['steps']} steps in {found['train_s']} s; held-out avg@n "
        f"{found['before']}% -> {found['after']}%; train accuracy {found['train_acc_first']}% (steps 1-3) -> "
        f"{found['train_acc_last']}% (last 3) |"
    )


if __name__ == "__main__":  # make gpu-model: python scripts/gpu_check_real.py SRC.gguf [PIECE_MB]
    src = Path(sys.argv[1]).expanduser()
    made = split(src, Path(__file__).resolve().parents[1] / PIECES_DIR, float(sys.argv[2]) if len(sys.argv) > 2 else 25)
    print(f"{PIECES_DIR}/: {len(made['pieces'])} pieces of {src.name} ({made['size'] / 1e6:.0f} MB), manifest.json")
    for p in made["pieces"]:
        print(f"  {p['name']} {p['size'] / 1e6:.1f} MB")
