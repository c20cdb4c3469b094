"""model.path as a Hugging Face Hub model id, read through the Hugging Face cache: offline, from a cache laid out here
as huggingface_hub lays it out (models--ORG--NAME/{refs, snapshots/<commit>, blobs}). Nothing downloads: every
test runs with HF_HUB_OFFLINE=1, and the library refuses any request then."""

import hashlib
import importlib
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import SMALL_OVERRIDES, make_policy, small_config
from dapo import cli
from dapo.model import directory
from dapo.model.loading import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[1]
MAIN_COMMIT = hashlib.sha1(b"main").hexdigest()  # what refs/main holds: the tiny model (seed 0)
V2_COMMIT = hashlib.sha1(b"v2").hexdigest()  # what the tag v2 holds: another tiny model (seed 1)


def add_snapshot(cache: Path, repo_id: str, model_dir: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """``model_dir``'s files as huggingface_hub caches a download of ``repo_id`` at ``commit``: each file a blob
    named by its hash, linked from snapshots/<commit>/, and refs/<ref> holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as the library writes it
    return snapshot


@pytest.fixture(scope="session")
def other_model_dir(other_tiny_model_dir):
    return other_tiny_model_dir


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir, other_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf-home") / "hub"
    add_snapshot(cache, "org/tiny", tiny_model_dir, MAIN_COMMIT, ("main",))
    add_snapshot(cache, "org/tiny", other_model_dir, V2_COMMIT, ("v2",))
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """HF_HUB_CACHE at the cache built here and HF_HUB_OFFLINE=1: in the environment for processes a run starts, and
    in huggingface_hub's constants, which it read from the environment when first imported."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(directory, "_SNAPSHOTS", {})  # resolved afresh in each test
    return hub_cache


def logits(model, ids=(5, 9, 2, 7)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


def test_the_cache_built_here_is_the_layout_huggingface_hub_reads(offline):
    from huggingface_hub import scan_cache_dir

    (repo,) = scan_cache_dir(offline).repos
    assert repo.repo_id == "org/tiny" and repo.repo_type == "model"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {MAIN_COMMIT: {"main"}, V2_COMMIT: {"v2"}}


def test_a_hub_id_loads_its_cached_snapshot_as_the_local_directory_would(offline, tiny_model_dir):
    assert directory.model_dir("org/tiny") == offline / "models--org--tiny" / "snapshots" / MAIN_COMMIT
    model, tokenizer = load_model_and_tokenizer("org/tiny")
    local, local_tokenizer = load_model_and_tokenizer(tiny_model_dir)
    assert torch.equal(logits(model), logits(local))
    assert tokenizer("7*6=42")["input_ids"] == local_tokenizer("7*6=42")["input_ids"] == [57, 44, 56, 63, 54, 52]
    assert model.name_or_path == str(directory.model_dir("org/tiny"))  # what vLLM is given to read


def test_a_revision_picks_its_snapshot_and_one_not_cached_is_one_line(offline, tiny_model_dir, other_model_dir):
    main_logits = logits(load_model_and_tokenizer(tiny_model_dir)[0])
    v2_logits = logits(load_model_and_tokenizer(other_model_dir)[0])
    assert not torch.allclose(main_logits, v2_logits)
    revisions = [("main", main_logits), (MAIN_COMMIT, main_logits), ("v2", v2_logits), (V2_COMMIT, v2_logits)]
    for revision, want in revisions:
        assert torch.equal(logits(load_model_and_tokenizer("org/tiny", revision=revision)[0]), want), revision
    with pytest.raises(FileNotFoundError) as err:
        directory.model_dir("org/tiny", "v3")
    assert str(err.value) == (
        f"model.path='org/tiny' at revision 'v3': no such local directory, the Hugging Face cache ({offline}) does "
        "not hold it and HF_HUB_OFFLINE=1 is set; download it where there is network (`hf download org/tiny "
        "--revision v3`) and copy that cache here (or point HF_HUB_CACHE at it), or give a local model directory"
    )
    other_commit = hashlib.sha1(b"v3").hexdigest()
    with pytest.raises(FileNotFoundError, match=f"at revision '{other_commit}': no such local directory"):
        directory.model_dir("org/tiny", other_commit)


def test_a_training_run_on_a_pinned_revision_loads_that_snapshot(offline, other_model_dir, tmp_path):
    cfg = small_config(tmp_path, "org/tiny", "model.revision=v2", "model.device=cpu")
    policy = make_policy(cfg)
    want = load_model_and_tokenizer(other_model_dir)[0]
    assert torch.equal(logits(policy.model), logits(want))


def test_a_training_step_on_a_hub_id_runs_and_its_config_keeps_the_hub_id(offline, tmp_path):
    import yaml

    from dapo.training import train

    cfg = small_config(tmp_path, "org/tiny", "train.total_steps=1", "rollout.backend=hf", "model.device=cpu")
    last = train(cfg)
    assert last["step"] == 1 and last["sampling/groups_kept"] == 4 and math.isfinite(last["actor/pg_loss"]), last
    assert "eval/arith/avg@2" in last
    saved = yaml.safe_load((cfg.run_dir / "checkpoints" / "step_000001" / "config.yaml").read_text())
    assert saved["model"]["path"] == "org/tiny" and saved["model"]["revision"] is None


def write_listing(cache: Path, repo_id: str, commit: str, names: list[str]) -> None:
    """The repository's file listing at ``commit`` as huggingface_hub 2 keeps it beside a snapshot it fetched
    (trees/<commit>.json), against which it finds a snapshot incomplete offline."""
    files = {name: {"size": 1, "blob_id": hashlib.sha1(name.encode()).hexdigest()} for name in names}
    trees = cache / f"models--{repo_id.replace('/', '--')}" / "trees"
    trees.mkdir(parents=True, exist_ok=True)
    (trees / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": files}))


@pytest.mark.skipif(
    not hasattr(importlib.import_module("huggingface_hub.errors"), "IncompleteSnapshotError"),
    reason="huggingface_hub < 2 keeps no listing beside a snapshot",
)
def test_offline_a_snapshot_lacking_only_files_no_load_reads_is_whole_enough(offline, tiny_model_dir, tmp_path):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    constants.HF_HUB_CACHE = str(cache)  # set back by the fixture's monkeypatch
    names = sorted(f.name for f in tiny_model_dir.iterdir())
    snapshot = add_snapshot(cache, "org/readme", tiny_model_dir, MAIN_COMMIT, ("main",))
    write_listing(cache, "org/readme", MAIN_COMMIT, [*names, "README.md", ".gitattributes"])  # as vLLM leaves a cache
    assert directory.model_dir("org/readme") == snapshot
    add_snapshot(cache, "org/shard", tiny_model_dir, MAIN_COMMIT, ("main",))
    write_listing(cache, "org/shard", MAIN_COMMIT, [*names, "model-00002-of-00002.safetensors"])  # a weight missing
    with pytest.raises(FileNotFoundError) as err:
        directory.model_dir("org/shard")
    assert str(err.value) == (
        f"model.path='org/shard': no such local directory, the Hugging Face cache ({cache}) holds it only in part "
        "and HF_HUB_OFFLINE=1 is set; download it where there is network (`hf download org/shard`) and copy that "
        "cache here (or point HF_HUB_CACHE at it), or give a local model directory"
    )


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(offline, other_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(other_model_dir, tmp_path / "org" / "tiny")
    assert directory.model_dir("org/tiny") == Path("org/tiny")
    assert directory.model_dir("org/tiny", "main") == Path("org/tiny")  # a revision is the hub's only


def test_a_hub_id_not_in_the_cache_offline_is_one_line(offline):
    with pytest.raises(FileNotFoundError) as err:
        directory.model_dir("org/missing")
    assert str(err.value) == (
        f"model.path='org/missing': no such local directory, the Hugging Face cache ({offline}) does not hold it "
        "and HF_HUB_OFFLINE=1 is set; download it where there is network (`hf download org/missing`) and copy that "
        "cache here (or point HF_HUB_CACHE at it), or give a local model directory"
    )


@pytest.mark.parametrize("path", ["/models/x", "./my-model", "../my-model", "a/b/c"])
def test_a_missing_path_that_is_no_hub_id_is_a_missing_directory(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        directory.model_dir(path)
    where = "" if path.startswith("/") else f" ({os.path.abspath(tmp_path / path)})"
    assert str(err.value) == (
        f"model.path={path!r}: no such directory{where}; give a local Hugging Face model directory (config.json, "
        "weights, tokenizer) or a Hugging Face Hub model id such as Qwen/Qwen2.5-0.5B-Instruct"
    )


def hub_error(kind: str, status: int):
    """The error huggingface_hub raises for an answer of the Hub with this status."""
    import huggingface_hub.errors as hub_errors

    http = __import__(hub_errors.Response.__module__.split(".")[0])
    response = http.Response(status, request=http.Request("GET", "https://huggingface.co/api/models/org/x"))
    return getattr(hub_errors, kind)(f"{status} answered", response=response)


@pytest.mark.parametrize(
    "kind, status, want",
    [
        (
            "RepositoryNotFoundError",
            404,
            "FileNotFoundError: model.path='org/x': no such local directory, and no model org/x on the Hugging Face "
            "Hub (or it is private and this machine has no token for it); check the spelling, log in with `hf auth "
            "login` (or set HF_TOKEN) for a private model, or give a local model directory",
        ),
        (
            "GatedRepoError",
            403,
            "PermissionError: model.path='org/x': the model is gated on the Hugging Face Hub; accept its terms at "
            "https://huggingface.co/org/x and log in with `hf auth login` (or set HF_TOKEN) with that account",
        ),
        (
            "RevisionNotFoundError",
            404,
            "FileNotFoundError: model.revision='v9': no such branch, tag or commit of org/x on the Hugging Face Hub; "
            "give one it has, or model.revision=null for its default branch",
        ),
    ],
)
def test_what_the_hub_answers_is_one_line(kind, status, want, offline, monkeypatch):
    """The Hub's answers (no model, a gated one, no such revision) as huggingface_hub raises them: here without a
    request, by its snapshot_download raising what it raises then."""
    import huggingface_hub

    def answered(*args, **kwargs):
        raise hub_error(kind, status)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", answered)
    with pytest.raises(Exception) as err:
        directory.model_dir("org/x", "v9" if kind == "RevisionNotFoundError" else None)
    assert f"{type(err.value).__name__}: {err.value}" == want


def test_the_cli_stops_on_a_hub_id_not_in_the_cache_in_one_line_with_exit_2(offline, tmp_path, capsys):
    runs = tmp_path / "runs"
    code = cli.main(["train", "configs/demo.yaml", "model.path=org/missing", f"run.dir={runs}", *SMALL_OVERRIDES])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: model.path='org/missing': no such local directory, the Hugging Face cache (")
    assert "HF_HUB_OFFLINE=1 is set; download it where there is network (`hf download org/missing`)" in err
    assert not runs.exists()
    code = cli.main(["eval", "--model", "org/tiny", "model.revision=v3", "eval.benchmarks=[arith]"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.startswith("error: model.path='org/tiny' at revision 'v3': no such local")
        and (err.count("\n") == 1)
    ), err


def test_dapo_eval_reads_a_hub_id(offline, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overrides = ["eval.benchmarks=[arith]", "eval.num_problems=2", "eval.n=2", "reward.num_workers=1"]
    assert cli.main(["eval", "--model", "org/tiny", "model.device=cpu", *overrides]) == 0
    assert (tmp_path / "eval" / "tiny" / "eval.json").is_file()


def test_the_python_api_evaluates_a_hub_id_at_cfg_model_revision(offline):
    from dapo import api
    from dapo.config import load_config

    settings = ["eval.num_problems=2", "eval.n=2", "reward.num_workers=1", "model.device=cpu"]
    result = api.evaluate("org/tiny", "arith", cfg=load_config("demo", settings))
    assert (result.name, result.n, result.num_problems) == ("arith", 2, 2)
    with pytest.raises(FileNotFoundError, match=r"^model.path='org/tiny' at revision 'v3': no such local directory"):
        api.evaluate("org/tiny", "arith", cfg=load_config("demo", [*settings, "model.revision=v3"]))


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_vllm
def test_vllm_reads_a_hub_id_from_the_cache(offline, tmp_path, monkeypatch):
    """vLLM reads the checkpoint itself, from the snapshot directory the trainer loaded. The shipped arith model: vLLM's
    CPU attention has no kernel for the conftest model's heads (tests/test_vllm.py)."""
    from huggingface_hub import constants

    from dapo.training import train

    cache = tmp_path / "hub"
    add_snapshot(cache, "org/arith", REPO / "assets" / "arith-base", MAIN_COMMIT, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cfg = small_config(
        tmp_path, "org/arith", "train.total_steps=1", "rollout.backend=vllm", "rollout.kv_cache_gib=0.0625",
        "model.device=cpu",
    )  # fmt: skip
    last = train(cfg)
    assert last["step"] == 1 and math.isfinite(last["actor/pg_loss"]) and last["rollout/logprob_abs_diff_max"] < 1e-2
