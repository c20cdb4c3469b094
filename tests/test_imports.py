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
    assert "dapo.algo" in g["dapo.phases"]  # from dapo import algo, is_weights
    assert "dapo.rewards" in g["dapo.dynamic_sampling"] or "dapo.rewards.graders" in g["dapo.dynamic_sampling"]
    assert "dapo.rollout.vllm" in g["dapo.rollout"]  # imported inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_only_the_cli_the_python_api_and_the_ablation_runner_import_the_training_loop():
    importers = {m for m, deps in graph().items() if "dapo.training" in deps}
    assert importers <= {"dapo.cli", "dapo.ablate", "dapo.api"}, importers


ENGINES_AND_UP = (
    "dapo.policy",
    "dapo.rollout",
    "dapo.dynamic_sampling",
    "dapo.evaluation",
    "dapo.metrics",
    "dapo.training",
    "dapo.run_setup",
    "dapo.cli",
    "dapo.ablate",
    "dapo.cluster",
    "dapo.api",
)
# (module, what it must never import): the floors of docs/architecture.md
FLOORS = [
    ("dapo.algo", lambda n: n.startswith("dapo.")),
    ("dapo.is_weights", lambda n: n.startswith("dapo.")),
    ("dapo.screening", lambda n: n.startswith("dapo.") and n != "dapo.batch"),
    ("dapo.resources", lambda n: n.startswith("dapo.")),
    ("dapo.memory", lambda n: n.startswith("dapo.")),
    ("dapo.watchdog", lambda n: n.startswith("dapo.")),
    ("dapo.kernels", lambda n: n.startswith("dapo.")),
    ("dapo.checkpoint_files", lambda n: n.startswith("dapo.")),
    ("dapo.checkpoint_shards", lambda n: n.startswith("dapo.")),
    (
        "dapo.checkpoint_writer",
        lambda n: n.startswith("dapo.") and n not in ("dapo.checkpoint_files", "dapo.checkpoint_shards"),
    ),
    ("dapo.rewards", lambda n: not n.startswith("dapo.rewards")),
    ("dapo.tools", lambda n: not n.startswith("dapo.tools")),
    ("dapo.batch", lambda n: n.startswith("dapo.")),
    ("dapo.micro_batch", lambda n: n.startswith("dapo.") and n != "dapo.batch"),
    ("dapo.data", lambda n: n not in ("dapo.tasks", "dapo.tasks.arith", "dapo.resources")),
    ("dapo.data_files", lambda n: n not in ("dapo.data", "dapo.resources")),
    *[
        (m, lambda n: n in ("dapo.training", "dapo.dynamic_sampling", "dapo.rollout", "dapo.evaluation", "dapo.algo"))
        for m in ("dapo.policy", "dapo.logprobs", "dapo.prefix")
    ],
    ("dapo.rollout", lambda n: n in ("dapo.training", "dapo.policy", "dapo.dynamic_sampling", "dapo.evaluation")),
    *[
        (m, lambda n: n in ENGINES_AND_UP)
        for m in (
            "dapo.config",
            "dapo.config_read",
            "dapo.parallel",
            "dapo.models",
            "dapo.checkpoint",
            "dapo.checkpoint_weights",
            "dapo.lora",
            "dapo.logits",
        )
    ],
    *[
        (m, lambda n: n in ("dapo.training", "dapo.run_setup", "dapo.cli", "dapo.ablate", "dapo.cluster", "dapo.api"))
        for m in (
            "dapo.phases",
            "dapo.dynamic_sampling",
            "dapo.async_rollout",
            "dapo.evaluation",
            "dapo.metrics",
            "dapo.log",
            "dapo.library_logging",
            "dapo.plots",
            "dapo.trackers",
        )
    ],
    ("dapo.run_setup", lambda n: n in ("dapo.training", "dapo.cli", "dapo.ablate", "dapo.cluster", "dapo.api")),
    ("dapo.training", lambda n: n in ("dapo.cli", "dapo.ablate", "dapo.cluster", "dapo.api")),
]


@pytest.mark.parametrize("prefix,forbidden", FLOORS, ids=[f[0] for f in FLOORS])
def test_lower_floors_do_not_import_upper_ones(prefix, forbidden):
    g = graph()
    bad = {
        (m, n)
        for m, deps in g.items()
        if m == prefix or m.startswith(prefix + ".")
        for n in deps
        if forbidden(n) and not n.startswith(prefix)
    }
    assert not bad, sorted(bad)


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
