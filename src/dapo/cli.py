"""Command line: ``dapo train``, ``dapo eval``, ``dapo demo``, ``dapo ablate``, ``dapo export``, ``dapo import-model``,
``dapo launch-ray``.

    dapo train configs/demo.yaml algo.eps_high=0.28 train.total_steps=10
    torchrun --nproc_per_node 8 -m dapo.cli train configs/dapo_qwen2.5_7b.yaml     # FSDP on one node
    dapo launch-ray configs/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8     # FSDP across nodes
    dapo export runs/dapo_qwen2.5_32b/checkpoints/step_000100 /models/dapo-step100
    dapo import-model SmolLM2-135M-Instruct.Q4_1.gguf ~/.cache/dapo/models/SmolLM2-135M-Instruct
    dapo eval --run runs/demo eval.benchmarks=[arith,aime2024] eval.n=8
    dapo demo
    dapo ablate --seeds 5 --jobs 2 --out runs/ablation
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
import typing
from pathlib import Path

from dapo.command_line import ONE_LINE, build_parser, command, misspelt_command, user_error  # noqa: F401
from dapo.command_line import arg as _arg
from dapo.config import Config, ConfigError, load_config, resolve_preset
from dapo.config.schema import Dtype
from dapo.config.summary import EVAL_SETTINGS, settings_summary
from dapo.runtime import starting

CONFIG = _arg("config", help="YAML preset, e.g. configs/demo.yaml")
OVERRIDES = _arg("overrides", nargs="*", metavar="key=value", help="settings, e.g. algo.eps_high=0.28 (keys below)")


@command(
    "train",
    "train (or resume) a run from a YAML preset plus dotted overrides",
    CONFIG,
    OVERRIDES,
    description="Train (or resume) a run. It lives in <run.dir>/<run.name> (runs/<preset name>): "
    "metrics.jsonl, train.log, samples/, checkpoints/. The preset says the cost: "
    "configs/demo.yaml is minutes on 2 CPU cores; the Qwen2.5 presets need GPUs.",
)
def cmd_train(args) -> int:
    from dapo.checkpoint import preemption

    preemption.PROCESS_ENDS_WITH_RUN = True
    cfg = load_config(resolve_preset(args.config), args.overrides)
    train_and_summarise(cfg, title=cfg.run.name)
    return 0


@command(
    "demo",
    "train a tiny model on the built-in task on CPU; print before/after accuracy",
    OVERRIDES,
    description="Train the ~1M-parameter model in assets/arith-base on the built-in arithmetic task "
    "(configs/demo.yaml: 60 steps, a few minutes on 2 CPU cores) into runs/demo, and print "
    "held-out accuracy before and after.",
)
def cmd_demo(args) -> int:
    cfg = load_config(resolve_preset("configs/demo.yaml"), args.overrides)
    train_and_summarise(cfg, title="DAPO on the built-in arithmetic task")
    print(f"(delete {cfg.run_dir} to train from scratch again)")
    return 0


def train_and_summarise(cfg, *, title: str) -> None:
    """Train (or resume) ``cfg``'s run, its directory removed again if the start fails; then the run's figure
    (plots/training.png) and the lines it ends with, rank 0 only under torchrun."""
    from dapo.checkpoint import removed_if_start_fails
    from dapo.training import train

    t0 = time.perf_counter()
    with removed_if_start_fails(cfg.run_dir):
        train(cfg)
    starting.training_ended()
    wall_s = time.perf_counter() - t0
    if os.environ.get("RANK", "0") != "0":
        return
    from dapo.reporting.plots import plot_training
    from dapo.reporting.run_log import read_metrics, run_summary

    rows = read_metrics(cfg.run_dir)
    png = plot_training(rows, cfg.run_dir / "plots" / "training.png", title=title) if rows else None
    print("\n".join(run_summary(rows, wall_s=wall_s, run_dir=cfg.run_dir, plot=png)))


@command(
    "export",
    "turn a checkpoint (sharded or not) into one Hugging Face model directory",
    _arg("checkpoint", help="a checkpoint directory, e.g. runs/NAME/checkpoints/step_000100"),
    _arg("out_dir", help="where to write the model (config, safetensors, tokenizer)"),
    _arg(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: write the peft adapter (adapter_config.json, adapter_model.safetensors) "
        "instead of the merged model",
    ),
    _arg(
        "--base",
        help="LoRA checkpoints: the base model directory, where it is no longer at the path the adapter config names",
    ),
    _arg("--trust-remote-code", action="store_true", help="run Python files shipped in the checkpoint"),
    description="Write a checkpoint's model as one Hugging Face model directory. A LoRA checkpoint "
    "exports its base model with the adapters merged in, or with --adapter the adapters "
    "alone (peft: PeftModel.from_pretrained(base, OUT_DIR)).",
)
def cmd_export(args) -> int:
    from dapo.checkpoint import check_whole
    from dapo.checkpoint.weights import export_hf

    if note := check_whole(Path(args.checkpoint)):
        print(note)
    out = export_hf(
        Path(args.checkpoint),
        Path(args.out_dir),
        trust_remote_code=args.trust_remote_code,
        adapter=args.adapter,
        base=Path(args.base) if args.base else None,
    )
    print(f"written: {out} ({'peft LoRA adapter' if args.adapter else 'Hugging Face model directory'})")
    return 0


@command(
    "import-model",
    "convert a GGUF model file into a Hugging Face model directory",
    _arg("src", help="a .gguf file of an architecture transformers reads (Llama, Qwen2, Mistral, ...)"),
    _arg("out_dir", help="where to write the model (safetensors, config, generation config, tokenizer)"),
    _arg(
        "--dtype",
        default="float32",
        choices=typing.get_args(Dtype),
        help="dtype of the written weights (the GGUF's quantised blocks are de-quantised)",
    ),
)
def cmd_import_model(args) -> int:
    from dapo.model.loading import import_gguf

    out = import_gguf(Path(args.src).expanduser(), Path(args.out_dir).expanduser(), dtype=args.dtype)
    print(f"written: {out} (Hugging Face model directory; use it as model.path={out})")
    return 0


@command(
    "tool-run",
    "run a Python file in the tool sandbox training uses; print what the model would see",
    _arg("file", help="a Python file, e.g. one a model wrote"),
    _arg("--config", help="a YAML preset whose tools.* settings to use (default: the defaults)"),
    OVERRIDES,
    description="Run FILE exactly as a model's code runs during training: the same sandbox (tools.sandbox) and "
    "limits (tools.timeout_s, cpu_s, memory_mb, processes, file_mb, output_chars); print the output block the "
    "model would be given, then one line on how the call ended. Checks that this machine can sandbox tools.",
)
def cmd_tool_run(args) -> int:
    from dapo.tools import output_block
    from dapo.tools.sandbox import Limits, Sandbox

    cfg = load_config(resolve_preset(args.config) if args.config else None, args.overrides)
    box = Sandbox(Limits.from_config(cfg.tools), kind=cfg.tools.sandbox)
    box.check()
    result = box.run(Path(args.file).read_text())
    print(output_block(result), end="")
    ended = f"failed: {result.error}" if result.failed else "exit 0"
    print(f"({ended}; {result.seconds:.2f} s in sandbox {cfg.tools.sandbox})", file=sys.stderr)
    return 0 if not result.failed else 1


@command(
    "launch-ray",
    "train with one Ray worker per GPU across a Ray cluster (FSDP)",
    _arg("config", help="YAML preset"),
    OVERRIDES,
    _arg(
        "--address",
        default="auto",
        help="Ray cluster address ('auto': the one `ray start --head` runs on this machine); "
        "'local' starts a private one-machine cluster for this run",
    ),
    _arg("--nodes", type=int, default=1, help="machines to spread the ranks over"),
    _arg("--gpus-per-node", type=int, default=0, help="ranks per machine, one GPU each"),
    _arg("--cpu-workers-per-node", type=int, default=0, help="CPU-only ranks per machine (gloo), without GPUs"),
    _arg(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPU slots reserved for each rank (default: 4 with --gpus-per-node, 1 for CPU workers)",
    ),
    _arg(
        "--num-cpus",
        type=int,
        default=0,
        help="with --address local: CPU slots of the private cluster (0: the machine's cores)",
    ),
    _arg(
        "--insecure",
        action="store_true",
        help="join (or start) a Ray cluster without token authentication: anyone who reaches its ports runs code",
    ),
    description="Train with one Ray worker per rank (FSDP). A first try on one machine, without a "
    "cluster: dapo launch-ray configs/demo.yaml --address local --cpu-workers-per-node 2",
)
def cmd_launch_ray(args) -> int:
    from dapo.cluster import Placement, launch

    cfg = load_config(resolve_preset(args.config), args.overrides)
    cpus = args.cpus_per_worker if args.cpus_per_worker is not None else (4.0 if args.gpus_per_node else 1.0)
    placement = Placement(
        nodes=args.nodes,
        workers_per_node=args.gpus_per_node or args.cpu_workers_per_node,
        gpus_per_worker=1.0 if args.gpus_per_node else 0.0,
        cpus_per_worker=cpus,
    )
    if placement.world_size < 1:
        raise ConfigError("launch-ray: give --gpus-per-node N (GPU workers) or --cpu-workers-per-node N (CPU workers)")
    ray_init = {"num_cpus": args.num_cpus} if args.address == "local" and args.num_cpus else {}
    launch(cfg, placement, train_on_rank, address=args.address, ray_init=ray_init, insecure=args.insecure)
    return 0


def train_on_rank(cfg: Config) -> dict:
    """What each rank of ``dapo launch-ray`` runs: the training loop, imported there. The driver places the ranks
    and waits for them, without torch or transformers (about 4 CPU seconds and 220 MB less on the head node)."""
    from dapo.training import train

    return train(cfg)


def eval_config(preset: str | None, run: Path | None, overrides: list[str]) -> Config:
    """What `dapo eval` reads: the run's saved config.yaml (with --run), then the preset, then the
    dotted overrides; with neither a run nor a preset, the defaults with AIME 2024 as the benchmark."""
    layers = [run / "config.yaml"] if run is not None and (run / "config.yaml").exists() else []
    layers += [resolve_preset(preset)] if preset else []
    return load_config(layers, ([] if layers else ["eval.benchmarks=[aime2024]"]) + overrides)


def latest_run_checkpoint(run: Path) -> Path:
    """The checkpoint `dapo eval --run` evaluates: the run's latest, whole and holding a model directory; a
    missing run, one without checkpoints or one whose model needs exporting first is one line naming the fix."""
    from dapo.checkpoint import check_whole, latest_checkpoint
    from dapo.runtime.files import CheckpointError

    if not run.is_dir():
        what = "is not a directory" if run.exists() else "does not exist"
        raise FileNotFoundError(
            f"--run {run} {what}: give the directory a training run writes (<run.dir>/<run.name>, e.g. runs/demo), "
            "or a model directory with --model DIR"
        )
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise FileNotFoundError(
            f"--run {run} has no checkpoint (looked in {run / 'checkpoints'}): a run writes one every "
            "run.save_every steps and at its end; evaluate a model directory with --model DIR instead"
        )
    if note := check_whole(ckpt):
        print(note)
    if not (ckpt / "model").is_dir():
        kind = "holds LoRA adapters" if (ckpt / "adapter").is_dir() else "is sharded"
        raise CheckpointError(f"{ckpt} {kind}; run `dapo export {ckpt} OUT_DIR` and evaluate --model OUT_DIR")
    return ckpt


@command(
    "eval",
    "avg@n, pass@k, maj@n on benchmarks for a model directory or a run",
    _arg(
        "items",
        nargs="*",
        metavar="[PRESET] [key=value ...]",
        help="a YAML preset (optional), then dotted overrides, e.g. eval.benchmarks=[arith,aime2024]",
    ),
    _arg(
        "--model",
        help="a Hugging Face model directory or Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct, revision by "
        "model.revision); the report goes to ./eval/<its name>/",
    ),
    _arg(
        "--run",
        help="run directory: evaluates its latest checkpoint with the run's config; "
        "the report goes to RUN_DIR/eval/step_NNNNNN/",
    ),
    _arg("--out", help="output directory instead"),
    usage="dapo eval [PRESET] (--model DIR | --run RUN_DIR) [--out DIR] [key=value ...]",
    formatter_class=argparse.RawDescriptionHelpFormatter,
    # evaluation's own settings, with the defaults `dapo eval` runs with (AIME 2024 without --run or a preset)
    settings=lambda: settings_summary(
        EVAL_SETTINGS,
        eval_config(None, None, []),
        "the settings dapo eval reads, with the defaults it runs with (--run: the run's; any setting is key=value):",
    ),
    description="""\
Evaluate a model on the benchmarks in eval.benchmarks. Settings come from the run's saved
config.yaml (with --run), then PRESET, then dotted overrides as for `dapo train`; the keys read
are eval.* (benchmarks, n, temperature, top_p, max_response_tokens, num_problems, seed),
data.template/max_prompt_tokens/overlong_prompts/columns/on_bad_row, reward.grader/function/
num_workers/timeout_s, rollout.backend (hf unless the config says otherwise) and
model.dtype/device/trust_remote_code. Each benchmark's layout, template and grader, and why,
are printed first and kept in eval.json and eval.md.

With neither --run nor PRESET the benchmark is AIME 2024, sampled as the DAPO paper reports it:
n=32 samples per problem, temperature 1.0, top-p 0.7, up to 20,480 tokens each. That takes hours
on a CPU; eval.num_problems=5 eval.n=4 eval.max_response_tokens=512 is a quick look. eval.n,
eval.temperature, eval.top_p and eval.max_response_tokens left null take each benchmark's own
setting (a data file: n=4, temperature 1.0, top-p 1.0, rollout.max_response_tokens).

The report (eval.json, eval.md, <benchmark>.problems.jsonl) comes with <benchmark>.responses.jsonl:
every sampled response, one JSON line each (id, sample, prompt, response, extracted_answer,
ground_truth, grader, correct, length_tokens, truncated).

  dapo eval --model ~/models/SmolLM2-135M-Instruct eval.benchmarks=[word] data.template=raw
  dapo eval --run runs/demo eval.n=8 rollout.backend=vllm""",
)
def cmd_eval(args) -> int:
    from rich.progress import Progress

    from dapo.data.train_sets import read_settings
    from dapo.evaluation import BENCHMARKS, evaluate_model, load_benchmark, write_report

    if not args.run and not args.model:
        raise ConfigError(
            "dapo eval: give --model DIR (a Hugging Face model directory or Hub id) or --run RUN_DIR (a run)"
        )
    if args.run and args.model:
        raise ConfigError(
            "dapo eval: give --model DIR or --run RUN_DIR, not both (--run evaluates the run's latest checkpoint with "
            "the run's config)"
        )
    ckpt = latest_run_checkpoint(Path(args.run)) if args.run else None
    preset = args.items[0] if args.items and "=" not in args.items[0] else None
    cfg = eval_config(preset, Path(args.run) if args.run else None, args.items[1 if preset else 0 :])
    if ckpt is not None:
        model_dir = ckpt / "model"
        # beside the checkpoints, not inside one: rotation deletes old checkpoints with all they hold
        default_out = Path(args.run) / "eval" / ckpt.name
    else:  # a directory, or a Hugging Face Hub id (kept as written: Path would turn ./my-model into my-model)
        model_dir = os.path.expanduser(args.model)
        local = os.path.exists(model_dir)
        default_out = Path("eval") / (Path(model_dir).resolve().name if local else Path(model_dir).name)
    read_as = {"num_problems": cfg.eval.num_problems, **read_settings(cfg.data)}
    benches = [load_benchmark(name, **read_as) for name in cfg.eval.benchmarks]
    with Progress() as progress:
        results = evaluate_model(
            model_dir,
            benches,
            cfg,
            progress=lambda name, total: functools.partial(
                progress.advance, progress.add_task(f"{name}: samples", total=total)
            ),
        )
    out_dir = Path(args.out) if args.out else default_out
    table = write_report(results, out_dir)
    if args.run:  # the training run's W&B / MLflow runs get the report beside its metrics
        from dapo.reporting.trackers import log_eval_report

        log_eval_report(cfg, Path(args.run), out_dir, warn=lambda text: print(text, file=sys.stderr))
    print(table.read_text())
    print(
        f"written: {out_dir}/eval.json, eval.md, <benchmark>.problems.jsonl  (known benchmarks: "
        f"{', '.join(BENCHMARKS)})"
    )
    for r in results:  # what the model wrote, to see why a score is what it is
        print(f"responses: {out_dir / f'{r.name}.responses.jsonl'}  ({len(r.responses)} samples, one JSON line each)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if wrong := misspelt_command(sys.argv[1:] if argv is None else argv):
        parser.error(wrong)
    # `dapo eval --model DIR eval.n=8`: overrides may follow the flags, which one positional list cannot take
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "eval" or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.items += extra
    verbose = getattr(args, "verbose", False)
    if verbose:
        os.environ["DAPO_VERBOSE"] = "1"  # worker processes (ablate, Ray) inherit it
    # a training command stopped while it starts (the imports below included) exits as one stopped mid-training
    with starting.stop_while_starting() if args.command in ("train", "demo") else contextlib.nullcontext():
        try:
            return _run(args, verbose)
        except starting.StoppedStarting as stop:
            if os.environ.get("RANK", "0") == "0":  # under torchrun every rank has the same line
                print(stop.line, file=sys.stderr, flush=True)
            return starting.EXIT_CODE


def _run(args, verbose: bool) -> int:
    from dapo.runtime.libraries import setup_library_logging

    models = args.command != "launch-ray"  # its driver loads no model (the ranks do): no transformers there
    setup_library_logging(transformers=models)  # library messages: warnings only on the console, until a run
    # adds its train.log
    if models:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-file load/save bars would drown the per-step lines
    try:
        return args.func(args)
    except Exception as err:
        from dapo.runtime.starting import Stopped

        if isinstance(err, Stopped):  # a signal stopped the run, its checkpoint written: one line, exit code 75
            if err.main:  # rank 0's (under torchrun every rank has the same line)
                print(err, file=sys.stderr, flush=True)
            return err.exit_code
        line = user_error(err)
        if line is None:
            raise
        if verbose:
            import traceback

            traceback.print_exc()
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
