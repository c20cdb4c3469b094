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

    make gpu-wheels gpu-model     # here, just before the lease: .gpu_model/ and its calls.md, the calls in order

The pieces are as large as the calls allow beside the working tree as it is then (64 MiB a call; the first call
also carries the wheels the lent machine lacks), so three calls carry the model; LEASE_* below say what each
call of one lease does, item r running with the last piece.

How the project's own GPU checks ran this (kept here, not in docs/: it is about the lent machines, not dapo). On
2026-11-27 the working tree as it travels (tracked files and untracked ones git does not ignore) was 31.1 MB, so
the GGUF went in three pieces (32.5, 33.9 and 31.9 MB, 2 MiB to spare each), the first call also carrying the five
wheels the lent image lacks (1.4 MB: math-verify, latex2sympy2_extended, antlr4, gguf, liger-kernel). The calls of
one 15-minute lease, most important first, each command starting with GPU_CHECK_COMMIT=<the commit> (the
machine's copy has no .git):

    call  carries                      runs                                                         budget
    1     5 wheels, manifest, piece 1  install,tests with GPU_CHECK_ITEMS=t (train.kernels on CUDA)  220 s
    2     manifest, piece 2            real: keeps the piece, reports r waiting                       40 s
    3     manifest, piece 3            real: item r joined, imported, 240 s of training, evaluated   360 s
    4     nothing                      bench with GPU_CHECK_BENCH_PARTS=peak,kernels                 300 s
    5     nothing                      demo with GPU_CHECK_DEMOS=demo_screening,demo_async (s, l)    130 s

Each call goes as soon as the last returns: the machine goes back 30 s after a call, and the pieces it kept go
with it. The budgets add up to 17.5 minutes, more than a 15-minute lease after a start of one to two, so the last
calls are the ones cut, and the kernels' figures and the two demos run again alone in a later lease. Rehearsed on
2 CPU cores (2026-11-27, GPU_CHECK_ALLOW_CPU=1, the five calls in a fresh clone given only what each call carries):
call 1 installed nothing new and ran item t's CPU case in 35 s; call 2 kept piece 2 and reported r waiting for
piece 3; call 3 joined the pieces, imported the model, trained until SIGTERM at GPU_CHECK_REAL_S=150 (2 steps,
checkpoint 1.0 s after the signal, exit 75) and evaluated it, 191 s in all; call 4 ran benchmarks/gpu.py --smoke
--parts peak,kernels in 32 s; call 5 ran the two demos shortened to 4 steps in 28 s.
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
CALL_LIMIT = 64 * 2**20  # what one call to the lent machine carries: the working tree and the carried paths
CALL_MARGIN = 2 * 2**20  # for the manifest and the tree's growth between make gpu-model and the lease
# the wheels of make gpu-wheels that the lent machines' image lacks (/work/.library/device/KINDS.md's list)
LENT_LACKS = ("math_verify", "latex2sympy2_extended", "antlr4_python3_runtime", "gguf", "liger_kernel")
PRESET = "configs/smollm2_135m.yaml"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def split(src: Path, out: Path, sizes: list[int]) -> dict:
    """``src`` cut into pieces of ``sizes`` bytes (the last one what is left) in ``out``, beside manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{src.name}.*"):
        old.unlink()
    size, pieces = src.stat().st_size, []
    with open(src, "rb") as f:
        for want in sizes:
            piece = out / f"{src.name}.{len(pieces) + 1:03d}"
            piece.write_bytes(f.read(want))
            pieces.append({"name": piece.name, "size": piece.stat().st_size, "sha256": sha256(piece)})
    assert sum(p["size"] for p in pieces) == size, "the sizes do not cover the file"
    manifest = {"file": src.name, "size": size, "sha256": sha256(src), "pieces": pieces}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def piece_sizes(total: int, tree: int, first_extra: int, limit: int = CALL_LIMIT) -> list[int]:
    """The fewest pieces of a ``total``-byte file such that each call carries the working tree (``tree`` bytes),
    the manifest and one piece within ``limit``, the first call also ``first_extra`` bytes (the wheels)."""
    room = limit - CALL_MARGIN - tree
    if room - first_extra <= 0:
        raise SystemExit(f"gpu-model: the working tree ({tree / 1e6:.1f} MB) leaves no room for a piece in a call")
    sizes, left = [], total
    while left > 0:
        sizes.append(min(left, room - (first_extra if not sizes else 0)))
        left -= sizes[-1]
    return sizes


def tree_bytes(root: Path) -> int:
    """What a call to the lent machine carries before any carried path: tracked files, untracked ones git does
    not ignore, and shared/ where the checkout has one."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True
    ).stdout.decode()
    files = {root / name for name in listed.split("\0") if name}
    files |= {f for f in (root / "shared").rglob("*") if f.is_file()} if (root / "shared").is_dir() else set()
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def lent_wheels(root: Path) -> list[Path]:
    """The wheels in .whl/ that the lent machines' image lacks (the rest it has, at versions that do)."""
    wheels = [w for w in sorted((root / ".whl").glob("*.whl")) if w.name.split("-")[0].lower() in LENT_LACKS]
    if missing := sorted(set(LENT_LACKS) - {w.name.split("-")[0].lower() for w in wheels}):
        raise SystemExit(f"gpu-model: .whl/ lacks {', '.join(missing)}: run make gpu-wheels first")
    return wheels


# One 15-minute lease (a machine's start takes one to two of them), in order of what matters most, each call
# (what it shows, timeout_s, its settings): the model's pieces come first, with the install and item t; item r as
# soon as the last piece is there; then the kernels' MFU figures and the two demos, cut first if time runs short.
LEASE_FIRST = (
    "the wheels installed; item t: train.kernels exact on CUDA against the CPU update",
    240,
    "GPU_CHECK_PARTS=install,tests GPU_CHECK_ITEMS=t GPU_CHECK_BUDGET_S=220",
)
LEASE_CARRY_ONLY = ("a piece of the model, kept", 60, "GPU_CHECK_PARTS=real GPU_CHECK_BUDGET_S=40")
LEASE_REAL = (
    "item r: SmolLM2 joined, imported, trained 240 s on CUDA, evaluated",
    380,
    "GPU_CHECK_PARTS=real GPU_CHECK_BUDGET_S=360",
)
LEASE_AFTER = (
    (
        "the update with each train.kernels variant against the eager one at the 0.5B and 1.5B shapes",
        320,
        "GPU_CHECK_PARTS=bench GPU_CHECK_BENCH_PARTS=peak,kernels GPU_CHECK_BUDGET_S=300",
    ),
    (
        "items s (screening) and l (generating ahead) on the demo",
        150,
        "GPU_CHECK_PARTS=demo GPU_CHECK_DEMOS=demo_screening,demo_async GPU_CHECK_BUDGET_S=130",
    ),
)


def lease_plan(manifest: dict, wheels: list[Path], commit: str) -> str:
    """The calls of one lease, in order: what each carries (the wheels with the first, a piece each while there
    are pieces) and its command."""
    pieces = [f"{PIECES_DIR}/{p['name']}" for p in manifest["pieces"]]
    calls = [LEASE_FIRST] + [LEASE_CARRY_ONLY] * max(0, len(pieces) - 2) + [LEASE_REAL, *LEASE_AFTER]
    lines = [
        f"# One lease, {len(calls)} calls, at commit {commit} (written by make gpu-model)",
        "",
        "Make each call as soon as the last returns: the machine goes back 30 s after a call, and the pieces it kept"
        " with it. The calls after item r are cut first when the lease runs short.",
        "",
    ]
    for k, (what, timeout, settings) in enumerate(calls):
        carry = [f".whl/{w.name}" for w in wheels] if k == 0 else []
        carry += [f"{PIECES_DIR}/manifest.json", *pieces[k : k + 1]] if k < len(pieces) else []
        lines += [
            f"{k + 1}. {what}; timeout_s {timeout}",
            f"   carry: {json.dumps(carry)}",
            f"   command: GPU_CHECK_COMMIT={commit} {settings} make gpu-check",
            "",
        ]
    return "\n".join(lines)


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


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hub_cache(model_dir: Path, cache: Path) -> Path:
    """``model_dir``'s files as the Hugging Face cache holds a download of HUB_ID (blobs named by their hash, linked
    from snapshots/<commit>/, refs/main naming the commit), so that ``model.path=HUB_ID`` loads with no network."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    commit = hashlib.sha1(HUB_ID.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    if not snapshot.exists():
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir(exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        for f in sorted(model_dir.iterdir()):
            blob = repo / "blobs" / sha256(f)
            if not blob.exists():
                shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs" / "main").write_text(commit)
    return cache


def part_real(check, state_dir: Path) -> dict:
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
    # the model as a user names it, by its Hub id, from a Hugging Face cache with no network (a hub-layout cache
    # made here from the imported directory): the machine's own huggingface_hub resolves it
    hub = {"HF_HUB_CACHE": str(hub_cache(model_dir, state_dir / "hf")), "HF_HUB_OFFLINE": "1"}
    overrides = [f"model.path={HUB_ID}", f"model.device={'cuda' if cuda else 'cpu'}", "rollout.backend=hf"]
    overrides += ["train.total_steps=1000", "eval.every_steps=null", "eval.before_train=true", "run.save_every=null"]
    overrides += [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}", "run.progress=false"]
    overrides += os.environ.get("GPU_CHECK_REAL_ARGS", "").split()
    seconds = float(os.environ.get("GPU_CHECK_REAL_S", 240))
    cmd = [sys.executable, "-m", "dapo.cli", "train", PRESET, *overrides]
    t0 = time.monotonic()
    # SIGTERM at the time: the run checkpoints its last completed step and exits 75
    code, out, _ = check.run(cmd, seconds, state_dir / "real_train.log", stop=signal.SIGTERM, **hub)
    found |= {"cuda": cuda, "command": " ".join(cmd[2:]), "train_exit": code, "train_s": round(time.monotonic() - t0)}
    if code not in (0, 75) or not (run_dir / "metrics.jsonl").exists():
        return found | {"error": f"training failed: {out[-2000:]}"}
    found |= read_run(run_dir)
    out_dir = state_dir / "real_eval"
    shutil.rmtree(out_dir, ignore_errors=True)
    eval_cmd = [sys.executable, "-m", "dapo.cli", "eval", "--run", str(run_dir), "--out", str(out_dir)]
    code, out, _ = check.run(eval_cmd, 300, state_dir / "real_eval.log", **hub)
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


def main() -> None:
    """make gpu-model: the GGUF cut to fit beside the working tree as it is now, and the lease's calls."""
    root = Path(__file__).resolve().parents[1]
    src = Path(sys.argv[1]).expanduser()
    wheels, tree = lent_wheels(root), tree_bytes(root)
    sizes = piece_sizes(src.stat().st_size, tree, sum(w.stat().st_size for w in wheels))
    made = split(src, root / PIECES_DIR, sizes)
    print(
        f"{PIECES_DIR}/: {len(sizes)} pieces of {src.name} ({made['size'] / 1e6:.1f} MB) beside a working tree "
        f"of {tree / 1e6:.1f} MB; the first call also carries {len(wheels)} wheels"
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    plan = lease_plan(made, wheels, commit.stdout.strip() or "?")
    (root / PIECES_DIR / "calls.md").write_text(plan + "\n")
    print(plan)


if __name__ == "__main__":  # make gpu-model: python scripts/gpu_check_real.py SRC.gguf
    main()
