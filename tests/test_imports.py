"""The package's import graph, read from the source: no cycles, and the layers of docs/architecture.md."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dapo"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, at the top or inside functions (a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    me = module_name(path)
    return {m for m in found if m != me}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {m: imports_of(p, set(files)) for m, p in files.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if n.startswith(m + "."):  # a package importing its own submodules is not a cycle
                continue
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state:
                found = visit(n, path + [m])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_the_reader_finds_imports_of_every_kind():
    g = graph()
    assert "dapo.algorithm.losses" in g["dapo.algorithm.step"]  # from dapo.algorithm import advantages, losses
    assert "dapo.rewards" in g["dapo.collect.scoring"] or "dapo.rewards.graders" in g["dapo.collect.scoring"]
    assert "dapo.rollout.vllm" in g["dapo.rollout.build"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


# The stages, lowest first: a package (or a top-level module) imports only its own modules and those of the packages
# on floors below it, never one beside it or above. The order is written here once; docs/architecture.md draws it.
FLOORS = [
    ("config",),  # the settings: a leaf, it imports nothing else of dapo
    ("runtime",),  # ranks and FSDP, the watchdog, memory, the libraries' logging, file modes
    ("data",),  # prompts, data files, the built-in task, the prompt order
    ("rewards", "tools"),  # graders of untrusted text and the grading a run's settings ask for; the sandboxed tool
    ("algorithm",),  # the objectives and the step's computations: no engine, no I/O
    ("model",),  # policy, log-probs, micro-batches, LoRA, loading
    ("rollout",),  # the engines
    ("collect",),  # dynamic sampling, screening, collection ahead of the trainer
    ("checkpoint",),  # save, load, resume, preemption
    ("reporting",),  # the run's log, metrics, notes, trackers, plots
    ("evaluation",),  # the entry points, each above the ones it uses
    ("run_setup",),
    ("training",),
    ("cluster", "ablate"),
    ("api",),
    ("command_line",),  # the command's frame: its parser and the line an error becomes
    ("cli",),
]
FLOOR_OF = {name: i for i, names in enumerate(FLOORS) for name in names}


def stage(module: str) -> str | None:
    """The package (or top-level module) a module belongs to; None for the package's face, ``dapo`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_has_a_floor():
    assert {stage(m) for m in graph()} - {None} == set(FLOOR_OF)


def test_each_stage_imports_only_the_stages_below_it():
    bad = sorted(
        (m, n)
        for m, deps in graph().items()
        for n in deps
        if stage(m) and stage(n) and stage(n) != stage(m) and FLOOR_OF[stage(n)] >= FLOOR_OF[stage(m)]
    )
    assert not bad, bad


def test_the_floor_rule_catches_an_import_upward():
    g = {"dapo.config.schema": {"dapo.data.prompts"}, "dapo.data.prompts": set()}
    assert [(m, n) for m, deps in g.items() for n in deps if FLOOR_OF[stage(n)] >= FLOOR_OF[stage(m)]] == [
        ("dapo.config.schema", "dapo.data.prompts")
    ]


PURE = [
    "dapo.algorithm.advantages",
    "dapo.algorithm.losses",
    "dapo.algorithm.rollout_correction",
    "dapo.algorithm.batch",
]


@pytest.mark.parametrize("module", PURE)
def test_the_algorithm_s_pure_modules_import_nothing_of_dapo_but_the_config_s_choices(module):
    """No I/O and no config object: of dapo, one another and the names of the choices the config offers (its
    Literals)."""
    assert not {n for n in graph()[module] if n.startswith("dapo")} - {"dapo.config.schema", *PURE}


def test_the_model_runs_the_loss_it_is_given():
    """Nothing in dapo.model decides anything about the algorithm: of it, the model knows the batch record alone."""
    g = graph()
    bad = {(m, n) for m, deps in g.items() if stage(m) == "model" for n in deps if stage(n) == "algorithm"}
    assert bad <= {(m, "dapo.algorithm.batch") for m in g} | {(m, "dapo.algorithm") for m in g}, sorted(bad)


def test_only_the_cli_the_python_api_and_the_ablation_runner_import_the_training_loop():
    importers = {m for m, deps in graph().items() if "dapo.training" in deps}
    assert importers <= {"dapo.cli", "dapo.ablate", "dapo.api"}, importers


def test_no_component_below_the_loop_is_handed_the_run():
    """The loop object is named in training.py alone: nothing below it takes a ``run`` parameter or reads
    ``run.<field>`` (components get what they need, so the graph above sees every dependency)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if module_name(path) in ("dapo.training", "dapo.cli", "dapo.api", "dapo.ablate", "dapo.cluster"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if "run" in names:
                    offenders.append(f"{module_name(path)}.{node.name}(run)")
    assert not offenders, offenders


def test_tools_never_import_torch():
    """The sandboxed tool's side is the standard library: torch stays with the rollout that calls it."""
    for path in (SRC / "tools").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(x.split(".")[0] in ("torch", "transformers", "vllm") for x in names), (path, names)


def test_rewards_never_import_torch():
    """Grading workers run untrusted text; they load the standard library and math-verify, not the trainer."""
    for path in (SRC / "rewards").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


def test_the_architecture_doc_points_at_the_current_lines():
    """docs/architecture.md is rendered from scripts/architecture.in.md; rerender it after moving code."""
    import subprocess
    import sys

    root = SRC.parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "scripts/architecture_lines.py"), str(root / "scripts/architecture.in.md")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == (root / "docs/architecture.md").read_text(), (
        "run: python scripts/architecture_lines.py scripts/architecture.in.md > docs/architecture.md"
    )


def test_engines_are_built_in_one_place():
    """Only rollout/build.py turns settings into engines: outside rollout/, nothing imports a backend or the
    transports ahead of the trainer, and collect/ only the engine interface."""
    internals = {f"dapo.rollout.{m}" for m in ("hf", "vllm", "remote", "ranks", "multi_turn")}
    outside = {(m, n) for m, deps in graph().items() if stage(m) != "rollout" for n in deps & internals}
    assert not outside, sorted(outside)
    collect = {n for m, deps in graph().items() if stage(m) == "collect" for n in deps if stage(n) == "rollout"}
    assert collect <= {"dapo.rollout.base"}, collect
