"""Evaluation as papers report it: avg@n, unbiased pass@k, maj@n, a bootstrap interval.

n samples per problem are drawn explicitly (never by repeating rows). The AIME default follows
the DAPO paper: n=32, temperature 1.0, top-p 0.7.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dapo.config.schema import DEFAULT_MAX_ROW_CHARS
from dapo.config.shipped import SHARE
from dapo.data.prompts import fit_prompts, make_encoder, model_context, prompt_limit, render_prompt
from dapo.reporting.run_log import write_responses
from dapo.rewards.sources import DataSet
from dapo.rollout.base import SamplingParams

INVALID_PREDS = {"[INVALID]", "[TIMEOUT]", "[CRASH]", ""}


@dataclass(frozen=True)
class Benchmark:
    """A benchmark and how it is sampled unless eval.* says otherwise."""

    name: str
    path: str | None  # relative to the shipped data/; None for the built-in task
    n: int = 32
    temperature: float = 1.0
    top_p: float = 0.7
    max_response_tokens: int | None = 20480  # None: rollout.max_response_tokens
    # how its rows were read (a dapo.data.files.DataRead; None: the built-in task or rows given in Python)
    read: object = field(default=None, compare=False, repr=False)


BENCHMARKS = {
    "aime2024": Benchmark("aime2024", "aime2024/aime-2024.dapo.parquet"),
    "aime2025": Benchmark("aime2025", "aime2025/test.jsonl"),
    "amc2023": Benchmark("amc2023", "amc2023/test.jsonl"),
    "math500": Benchmark("math500", "math500/test.jsonl", n=4),
    "gsm8k": Benchmark("gsm8k", "gsm8k/test.jsonl", n=1, max_response_tokens=2048),
    # English word problems for small real models (configs/smollm2_135m.yaml samples at 0.7 too)
    "word": Benchmark("word", "word_problems/test.jsonl", n=4, temperature=0.7, top_p=1.0, max_response_tokens=96),
    "arith": Benchmark("arith", None, n=4, top_p=1.0, max_response_tokens=48),
    "arith-hard": Benchmark("arith-hard", None, n=4, top_p=1.0, max_response_tokens=96),
    "arith-long": Benchmark("arith-long", None, n=4, top_p=1.0, max_response_tokens=40),
}


def load_benchmark(
    name_or_path: str,
    *,
    template: str = "dapo",
    num_problems: int | None = None,
    max_row_chars: int = DEFAULT_MAX_ROW_CHARS,
    columns: Sequence[str] = (),
    on_bad_row: str = "stop",
):
    """(Benchmark, examples) for a registered name, the built-in task, a data file, a folder of them or a Hugging
    Face dataset id (its test split, unless it names one)."""
    from dapo.data import hub
    from dapo.data.files import read_data, source_origin

    if name_or_path in ("arith", "arith-hard", "arith-long"):
        from dapo.data import arith

        bench = BENCHMARKS[name_or_path]
        difficulty = name_or_path.partition("-")[2] or "demo"
        examples = arith.make_examples("test", num_problems or 200, difficulty=difficulty)
        return bench, examples
    read_as = {"template": template, "max_row_chars": max_row_chars, "columns": columns, "on_bad_row": on_bad_row}
    if name_or_path in BENCHMARKS:
        bench = BENCHMARKS[name_or_path]
        read = read_data(SHARE / "data" / bench.path, data_source=name_or_path, split="test", **read_as)
    else:
        path = Path(name_or_path)
        if not path.exists() and not hub.is_dataset_id(name_or_path):
            raise FileNotFoundError(
                f"benchmark {name_or_path!r} is neither a known name ({', '.join(BENCHMARKS)}), an existing file or "
                "folder, nor a Hugging Face dataset id (ORG/NAME[:CONFIG[:SPLIT]])"
            )
        # a data file has no settings of its own: it is sampled as the training run samples it, and named and
        # graded as training names a file's rows (its own data_source, else the folder's name for test.jsonl)
        read = read_data(name_or_path, split="test", **read_as)
        name = source_origin(path)[1] if path.exists() else hub.dataset_id(name_or_path).rsplit("/", 1)[-1]
        bench = Benchmark(name, name_or_path, n=4, top_p=1.0, max_response_tokens=None)
    examples = read.examples[:num_problems] if num_problems else read.examples
    return replace(bench, read=read), examples


def held_out_set(bench: Benchmark, examples: list, template: str) -> DataSet:
    """A (Benchmark, examples) pair of an evaluation as its start line names it."""
    known = BENCHMARKS.get(bench.name) == bench  # a benchmark by name, not a file of the same name
    if bench.path is None:  # the built-in task, or rows given to dapo.train
        if known:
            return DataSet(f"eval {bench.name}", examples, None)
        label = f"eval {bench.name} (given to dapo.train)"
    else:
        label = f"eval {bench.name}" if known else f"eval {bench.path}"
    if bench.read is None:
        return DataSet(label, examples, template)
    named = ("benchmark's name", bench.name) if known else bench.read.named
    return replace(DataSet.of(label, bench.read, template), examples=examples, named=named)


def sampling_settings(bench: Benchmark, cfg, *, in_training: bool = False) -> dict:
    """n, temperature, top_p and max_new_tokens for ``bench`` under ``cfg`` (a Config): eval.* where
    set, else the benchmark's own. In training the length limit falls back to
    rollout.max_response_tokens instead, as the rollout engine is sized for the run's lengths."""
    e = cfg.eval
    own_limit = None if in_training else bench.max_response_tokens
    return {
        "n": bench.n if e.n is None else e.n,
        "temperature": bench.temperature if e.temperature is None else e.temperature,
        "top_p": bench.top_p if e.top_p is None else e.top_p,
        "max_new_tokens": e.max_response_tokens or own_limit or cfg.rollout.max_response_tokens,
    }


# ---- the statistics --------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_accuracy(preds: list[str], accs: list[bool]) -> float:
    """Accuracy of the majority answer; a tie scores the expected accuracy of a random pick
    among the tied answers (so ties are neither rewarded nor punished by the order of samples).
    Invalid predictions do not vote unless nothing else is there."""
    votes = Counter(p for p in preds if p not in INVALID_PREDS)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [p for p, c in votes.items() if c == top]
    correct = {p for p, a in zip(preds, accs) if a}
    return sum(p in correct for p in tied) / len(tied)


def bootstrap_ci(values: list[float], *, seed: int = 0, iters: int = 1000, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean, resampling problems with replacement."""
    if not values:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    lo = means[int((1 - level) / 2 * iters)]
    hi = means[min(iters - 1, int((1 + level) / 2 * iters))]
    return (lo, hi)


@dataclass
class EvalResult:
    name: str
    n: int
    num_problems: int
    avg: float  # avg@n: mean accuracy over the graded samples
    ci: tuple[float, float]
    pass_at: dict[int, float]
    maj: float
    mean_length: float
    truncated_frac: float
    per_problem: list[dict] = field(default_factory=list)
    responses: list[dict] = field(default_factory=list)  # one per sample: what the model wrote and its verdict
    tools: dict[str, float] = field(default_factory=dict)  # with tools.python: how the responses used the tool
    # samples whose grading was given up on (out of time twice): left out of avg@n, pass@k and maj@n, never
    # counted wrong; a problem with none graded is left out of them too
    ungraded: int = 0
    # which template and grader it was read and graded with, and why (the line `dapo eval` prints first)
    grading: str = ""

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        avg = f"{prefix}/{self.name}/avg@{self.n}"
        return {
            avg: self.avg,
            f"{prefix}/{self.name}/ungraded": self.ungraded,
            f"{avg}_ci_low": self.ci[0],
            f"{avg}_ci_high": self.ci[1],
            f"{prefix}/{self.name}/maj@{self.n}": self.maj,
            f"{prefix}/{self.name}/response_length_mean": self.mean_length,
            f"{prefix}/{self.name}/truncated_frac": self.truncated_frac,
            **{f"{prefix}/{self.name}/pass@{k}": v for k, v in self.pass_at.items()},
            **{f"{prefix}/{self.name}/{k}": v for k, v in self.tools.items()},
        }


def tool_use(calls: list[int], errors: list[int], accs: list[bool]) -> dict[str, float]:
    """How responses used the tool: the share that called it, the share whose call helped (called and ended
    right), the accuracy of those that called and of those that did not, and errors per call."""
    called = [a for c, a in zip(calls, accs) if c]
    not_called = [a for c, a in zip(calls, accs) if not c]
    n = max(len(accs), 1)
    out = {"tool_call_frac": len(called) / n, "tool_helped_frac": sum(called) / n}
    out["tool_errors_per_call"] = sum(errors) / max(sum(calls), 1)
    if called:
        out["acc_with_tool_call"] = sum(called) / len(called)
    if not_called:
        out["acc_without_tool_call"] = sum(not_called) / len(not_called)
    return out


def evaluate(
    engine,
    encode,
    examples,
    pool,
    sampling: SamplingParams,
    *,
    name: str,
    grader: str = "auto",
    progress=None,
    render=None,
) -> EvalResult:
    """Sample ``sampling.n`` responses per problem, grade them (raw correctness, no shaping) and summarise.

    ``encode(example)`` gives the prompt ids; ``progress(k)``, if given, hears of every k samples graded;
    ``render(example)`` is the prompt text the responses record (the chat template applied), else the
    example's own text."""
    n = sampling.n
    ks = [k for k in (2**i for i in range(20)) if k <= n]
    responses, tool_errors = sample_and_grade(
        engine, encode, examples, pool, sampling, grader=grader, progress=progress, render=render
    )
    graded = [r for r in responses if not r["ungraded"]]
    accs = [r["correct"] for r in graded]
    lengths = [r["length_tokens"] for r in responses]
    truncated = [r["truncated"] for r in responses]
    calls = [r["tool_calls"] for r in responses if "tool_calls" in r]
    per_problem = [problem_summary(ex, responses[i * n : (i + 1) * n]) for i, ex in enumerate(examples)]
    scored = [r for r in per_problem if r["num_graded"]]  # problems with a graded sample
    return EvalResult(
        name=name,
        n=n,
        num_problems=len(examples),
        avg=sum(accs) / max(len(accs), 1),
        ci=bootstrap_ci([r["accuracy"] for r in scored], seed=sampling.seed),
        pass_at={k: sum(problem_pass_at(r, k) for r in scored) / max(len(scored), 1) for k in ks},
        maj=sum(r["maj_correct"] for r in scored) / max(len(scored), 1),
        mean_length=sum(lengths) / max(len(lengths), 1),
        truncated_frac=sum(truncated) / max(len(truncated), 1),
        per_problem=per_problem,
        responses=responses,
        tools=tool_use(calls, tool_errors, [r["correct"] for r in responses]) if calls else {},
        ungraded=len(responses) - len(graded),
    )


def problem_pass_at(problem: dict, k: int) -> float:
    """pass@k of a problem from its graded samples: with fewer than k of them (some ungraded), pass@(all graded)."""
    graded = problem["num_graded"]
    return pass_at_k(graded, problem["num_correct"], min(k, graded))


def sample_and_grade(
    engine, encode, examples, pool, sampling: SamplingParams, *, grader: str, progress, render
) -> tuple[list[dict], list[int]]:
    """Every sample's record (a line of <benchmark>.responses.jsonl), problem by problem, and with tools each
    sample's failed calls (none without)."""
    from dapo.rewards import graders_for

    n, seed = sampling.n, sampling.seed
    responses: list[dict] = []
    errors: list[int] = []
    chunk = max(1, 4096 // n)  # problems per generate call, so progress moves and memory stays flat
    for start in range(0, len(examples), chunk):
        part = examples[start : start + chunk]
        gen = engine.generate([encode(ex) for ex in part], replace(sampling, seed=seed + start))
        rows = [ex for ex in part for _ in range(n)]
        names = graders_for([ex.data_source for ex in rows], grader)
        result = pool.score(gen.texts, [ex.ground_truth for ex in rows], names)
        if gen.tool_logs is not None:
            errors += [log.errors for log in gen.tool_logs]
        prompts = {ex.uid: render(ex) if render is not None else ex.text() for ex in part}
        for j, (ex, text, g, ids, cut) in enumerate(
            zip(rows, gen.texts, result.grades, gen.response_ids, gen.truncated.tolist())
        ):
            responses.append(
                {
                    "id": ex.uid,
                    "sample": j % n,
                    "prompt": prompts[ex.uid],
                    "response": text,
                    "extracted_answer": g.pred,
                    "ground_truth": ex.ground_truth,
                    "grader": names[j],
                    "correct": g.acc,
                    "ungraded": g.ungraded,
                    "length_tokens": len(ids),
                    "truncated": cut,
                }
                | ({"tool_calls": gen.tool_logs[j].calls} if gen.tool_logs is not None else {})
            )
        if progress is not None:
            progress(len(rows))
    return responses, errors


def problem_summary(example, responses: list[dict]) -> dict:
    """A line of <benchmark>.problems.jsonl: how the problem's samples (``responses``, their records) did; its
    accuracy is over the graded ones (None when grading gave up on all)."""
    graded = [r for r in responses if not r.get("ungraded")]
    accs, preds = [r["correct"] for r in graded], [r["extracted_answer"] for r in graded]
    votes = Counter(p for p in preds if p not in INVALID_PREDS)
    return {
        "id": example.uid,
        "ground_truth": example.ground_truth,
        "accuracy": sum(accs) / len(graded) if graded else None,
        "num_correct": sum(accs),
        "num_graded": len(graded),
        "majority_answer": votes.most_common(1)[0][0] if votes else None,
        "maj_correct": majority_accuracy(preds, accs),
    }


def evaluate_model(model_dir, benches: list, cfg, *, reward_fn=None, progress=None, say=print) -> list[EvalResult]:
    """Load the model directory and evaluate it on each (Benchmark, examples) of ``benches`` as ``cfg``
    (a Config) says: eval.* sampling, data.max_prompt_tokens and overlong_prompts, rollout.backend, reward.* and
    model.dtype/device/trust_remote_code. ``reward_fn`` (a caller's reward function) grades every
    response instead of reward.grader, in the same worker pool, as reward.function's function does (not both).
    ``progress(name, total)``, if given, returns the callback that hears of every k samples of that benchmark
    graded. ``say`` hears the lines saying what it does: each benchmark's template and grader, and why (also in
    each result's ``grading``), a prompt limit capped to the model, the prompts over it."""
    from dapo.model.loading import load_model_and_tokenizer, pick_device
    from dapo.rewards.reward_fn import grader_name
    from dapo.rewards.setup import grading_function, grading_pool
    from dapo.rewards.sources import graders_of
    from dapo.rollout import build
    from dapo.runtime.threads import fit_torch_threads

    fit_torch_threads()  # no more threads than the CPUs this process may use

    m, d, e = cfg.model, cfg.data, cfg.eval
    probe_truth = next((examples[0].ground_truth for _, examples in benches if examples), "1")
    reward_fn = grading_function(cfg, reward_fn, probe_truth=probe_truth)  # before the model: a bad one stops here
    sets = [held_out_set(bench, examples, d.template) for bench, examples in benches]
    grader, lines = eval_grading(cfg, sets, reward_fn)
    for line in lines:
        say(line)
    model, tokenizer = load_model_and_tokenizer(
        model_dir, m.dtype, pick_device(m.device), revision=m.revision, trust_remote_code=m.trust_remote_code
    )
    settings = [sampling_settings(bench, cfg) for bench, _ in benches]
    budget = max(s["max_new_tokens"] for s in settings)
    limit, capped = prompt_limit(d.max_prompt_tokens, model_context(model.config), budget, "eval.max_response_tokens")
    encode = make_encoder(tokenizer, limit)
    kept = []
    for (bench, examples), data in zip(benches, sets):
        examples, counted = fit_prompts(data.label, examples, encode, d.overlong_prompts)
        kept.append((bench, examples))
        for line in filter(None, [capped, counted]):
            say(line)
            capped = None
    engine = build.evaluation_engine(cfg, model, tokenizer, max_model_len=limit + budget)
    render = functools.partial(render_prompt, tokenizer=tokenizer)
    results = []
    with grading_pool(cfg, reward_fn, graders=graders_of(sets, grader)) as pool:
        for (bench, examples), setting, line in zip(kept, settings, lines):
            result = evaluate(
                engine,
                encode,
                examples,
                pool,
                SamplingParams(**setting, seed=e.seed),
                name=bench.name,
                grader=grader if reward_fn is None else grader_name(reward_fn),
                progress=progress and progress(bench.name, setting["n"] * len(examples)),
                render=render,
            )
            results.append(replace(result, grading=line))
    return results


def eval_grading(cfg, sets: list[DataSet], reward_fn) -> tuple[str | dict[str, str], list[str]]:
    """What grades the held-out ``sets``: reward.grader, or for auto the graders their rows chose by data source
    (``dapo.rewards.sources.auto_graders``); and each set's line saying its template and grader, and why."""
    from dapo.rewards.sources import auto_graders, grading_line, row_graders

    custom = None
    if reward_fn is not None:
        spec = cfg.reward.function
        custom = "your reward function" + (f" (reward.function={spec})" if spec is not None else "")
    auto = cfg.reward.grader == "auto" and reward_fn is None
    chosen = row_graders(sets) if auto else {}
    lines = [grading_line(data, grader=cfg.reward.grader, custom=custom, chosen=chosen) for data in sets]
    return (auto_graders(sets) if auto else cfg.reward.grader), lines


class HeldOut:
    """Held-out evaluation during training: each (Benchmark, examples) of ``eval_sets`` sampled with ``engine`` as
    the run's settings say for it (``sampling_settings``), graded in the run's ``pool`` by ``grader`` (a caller's
    reward function's name, or None: reward.grader)."""

    def __init__(self, cfg, engine, encode, eval_sets: list, pool, grader: str | None, tokenizer):
        self.cfg, self.engine, self.encode, self.eval_sets, self.pool = cfg, engine, encode, eval_sets, pool
        self.grader = grader or cfg.reward.grader
        self.render = functools.partial(render_prompt, tokenizer=tokenizer)

    def __call__(self) -> list[EvalResult]:
        results = []
        for bench, examples in self.eval_sets:
            sampling = SamplingParams(**sampling_settings(bench, self.cfg, in_training=True), seed=self.cfg.eval.seed)
            results.append(
                evaluate(
                    self.engine, self.encode, examples, self.pool, sampling, name=bench.name, grader=self.grader,
                    render=self.render,
                )
            )  # fmt: skip
        return results


def write_report(results: list[EvalResult], out_dir: Path) -> Path:
    """eval.json, eval.md (a Markdown table), <benchmark>.problems.jsonl (one line per problem) and
    <benchmark>.responses.jsonl (one line per sampled response) in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {r.name: {k: v for k, v in asdict(r).items() if k not in ("per_problem", "responses")} for r in results}
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=2))
    lines = [
        "| benchmark | problems | n | avg@n | 95% CI | ungraded | maj@n | pass@k | mean length | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        passes = ", ".join(f"@{k} {v:.3f}" for k, v in r.pass_at.items())
        lines.append(
            f"| {r.name} | {r.num_problems} | {r.n} | {r.avg:.3f} | [{r.ci[0]:.3f}, {r.ci[1]:.3f}] | {r.ungraded} | "
            f"{r.maj:.3f} | {passes} | {r.mean_length:.1f} | {r.truncated_frac:.3f} |"
        )
    graded = [f"- {r.grading}" for r in results if r.grading]  # which template and grader, and why
    lines += ["", "Read and graded as:", "", *graded] if graded else []
    (out_dir / "eval.md").write_text("\n".join(lines) + "\n")
    for r in results:
        with open(out_dir / f"{r.name}.problems.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in r.per_problem)
        write_responses(r, out_dir / f"{r.name}.responses.jsonl")
    return out_dir / "eval.md"
