"""The model directory a ``model.path`` names, checked before a library reads it.

``model_dir(path, revision)`` is the one place a model's location is resolved: a local directory as it is
(``assets/...``: the package's copy when the current directory has none), or a model id on the Hugging Face Hub
(``Qwen/Qwen2.5-0.5B-Instruct``) fetched with huggingface_hub's ``snapshot_download`` into its cache, which
honours HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE as every Hugging Face library does. A local path that
exists always wins over a hub id of the same spelling. Every reader (the tokenizer, the policy, the reference,
the engines, the rollout process) loads the local directory it returns, so a branch that moves on the Hub
while a run starts cannot give two of them different weights.

The directory is then checked (config.json readable and naming an architecture, weights, and after loading a
tokenizer with a vocabulary): a broken one stops in one line naming model.path, what is missing or wrong and
the fix, where the libraries would fail later in a traceback (or, without tokenizer files, in generate).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dapo.config.shipped import shipped

EXAMPLE_HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
# Files of other frameworks and formats that nothing here reads (TensorFlow, Flax, Rust, ONNX, TFLite, GGUF, Core ML,
# OpenVINO, Meta's original checkpoint beside the Hugging Face one): a snapshot skips them, as the libraries'
# own loaders never fetch them. Some repositories hold several times the model's size in them.
NOT_READ = (
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.onnx",
    "*.onnx_data",
    "*.tflite",
    "*.gguf",
    "*.mlmodel",
    "onnx/*",
    "openvino/*",
    "coreml/*",
    "original/*",
)
# What a model load reads (config, weights, tokenizer and chat template, a model's own code): offline, a cached
# snapshot that lacks only other files (a README, images) is whole enough
MODEL_FILES = ("*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py", "*.spm")
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
# the names of the files a tokenizer can be read from (tokenizer.json, vocab.json, merges.txt, tokenizer.model,
# spiece.model, *.tiktoken, tekken.json, ...), to list in the message when none gave a vocabulary
TOKENIZER_NAME_PARTS = ("token", "vocab", "merges", "spiece", "sentencepiece", "tiktoken", "tekken")

log = logging.getLogger(__name__)
# (hub id, revision, cache directory) -> its snapshot directory, resolved once per process
_SNAPSHOTS: dict[tuple[str, str | None, str], Path] = {}


def is_hub_id(path: str | os.PathLike) -> bool:
    """Whether ``path`` is spelled as a Hugging Face Hub model id (``name`` or ``org/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(path))
    except HFValidationError:
        return False
    return True


def model_dir(path: str | os.PathLike, revision: str | None = None) -> Path:
    """The checked local directory of ``path``: a model directory that exists, else the snapshot of the hub
    model ``path`` names at ``revision`` (a branch, tag or commit; None: the default branch), fetched into the
    Hugging Face cache once per process. ``revision`` applies to a hub id only, as in transformers'
    ``from_pretrained``. Raises FileNotFoundError, NotADirectoryError, PermissionError or ValueError with one
    line naming model.path and the fix."""
    shown = str(path)
    local = shipped(path)
    if local.exists() or not is_hub_id(shown):
        return checked_dir(local, shown)
    return checked_dir(hub_snapshot(shown, revision), shown)


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of hub model ``repo_id`` at ``revision``, fetched into the Hugging Face cache when it is
    not there (or not whole) and the Hub can be reached; errors of the Hub or the cache in one line."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    key = (repo_id, revision, str(constants.HF_HUB_CACHE))
    if key in _SNAPSHOTS:
        return _SNAPSHOTS[key]
    try:
        snapshot = _download(repo_id, revision)
    except RevisionNotFoundError as err:
        raise FileNotFoundError(
            f"model.revision={revision!r}: no such branch, tag or commit of {repo_id} on the Hugging Face Hub; give "
            "one it has, or model.revision=null for its default branch"
        ) from err
    except RepositoryNotFoundError as err:  # a gated one too (a subclass), and 401 without a token
        raise _not_on_hub(repo_id, err) from err
    except LocalEntryNotFoundError as err:  # not in the cache (or not whole) and the Hub unreachable
        raise FileNotFoundError(_not_cached(repo_id, revision, err, constants.HF_HUB_CACHE)) from err
    log.info("model.path=%s (revision %s): %s", repo_id, revision or "the default branch", snapshot)
    _SNAPSHOTS[key] = snapshot
    return snapshot


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import errors, snapshot_download

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # huggingface_hub 2: a snapshot known to lack files
    try:
        return Path(snapshot_download(repo_id, revision=revision, ignore_patterns=list(NOT_READ)))
    except incomplete:
        # offline, with the cache's listing of the repository naming files its snapshot lacks (it was fetched with
        # allow_patterns, as vLLM fetches): whole enough when none of them is a file a model load reads
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=list(MODEL_FILES), ignore_patterns=list(NOT_READ)
            )
        )


def _not_on_hub(repo_id: str, err: Exception) -> Exception:
    from huggingface_hub.errors import GatedRepoError

    login = "log in with `hf auth login` (or set HF_TOKEN)"
    if isinstance(err, GatedRepoError):
        return PermissionError(
            f"model.path={repo_id!r}: the model is gated on the Hugging Face Hub; accept its terms at "
            f"https://huggingface.co/{repo_id} and {login} with that account"
        )
    return FileNotFoundError(
        f"model.path={repo_id!r}: no such local directory, and no model {repo_id} on the Hugging Face Hub (or it "
        f"is private and this machine has no token for it); check the spelling, {login} for a private model, or "
        "give a local model directory"
    )


def _not_cached(repo_id: str, revision: str | None, err: Exception, cache: str) -> str:
    """The one line for a hub model the cache lacks (or holds in part) while the Hub cannot be reached."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    cause = err.__cause__
    if isinstance(cause, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE=1 is set"
    elif cause is not None:
        why = f"the Hub cannot be reached: {type(cause).__name__}: {' '.join(str(cause).split())[:200]}"
    else:
        why = "the Hub cannot be reached"
    at = f" at revision {revision!r}" if revision else ""
    held = "holds it only in part" if type(err).__name__ == "IncompleteSnapshotError" else "does not hold it"
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return (
        f"model.path={repo_id!r}{at}: no such local directory, the Hugging Face cache ({cache}) {held} and {why}; "
        f"download it where there is network (`{download}`) and copy that cache here (or point HF_HUB_CACHE at it), "
        "or give a local model directory"
    )


def checked_dir(directory: Path, shown: str) -> Path:
    """``directory`` when it is a model directory transformers can load (config.json naming an architecture,
    weights), else one line naming model.path (``shown``, as the user wrote it), what is wrong and the fix."""
    absolute = os.path.abspath(directory)  # where a relative path was looked for (.. resolved)
    where = "" if absolute == shown else f" ({absolute})"
    if not directory.exists():
        raise FileNotFoundError(
            f"model.path={shown!r}: no such directory{where}; give a local Hugging Face model directory "
            f"(config.json, weights, tokenizer) or a Hugging Face Hub model id such as {EXAMPLE_HUB_ID}"
        )
    if not directory.is_dir():
        fix = (
            f"convert it with `dapo import-model {shown} OUT_DIR` and give OUT_DIR"
            if directory.suffix.lower() == ".gguf"
            else "give the directory that holds the model's config.json, weights and tokenizer"
        )
        raise NotADirectoryError(f"model.path={shown!r} is a file, not a model directory; {fix}")
    ggufs = sorted(p.name for p in directory.glob("*.gguf"))
    gguf_fix = f"; or convert {ggufs[0]} with `dapo import-model` and give its OUT_DIR" if ggufs else ""
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={shown!r} is not a Hugging Face model directory (no config.json in it{where}); give the "
            f"directory that holds the model's config.json, weights and tokenizer{gguf_fix}"
        )
    _check_config(directory / "config.json", shown)
    names = [p.name for p in directory.iterdir()]
    if not any(n.endswith(WEIGHT_SUFFIXES) or (n.startswith("pytorch_model") and n.endswith(".bin")) for n in names):
        raise FileNotFoundError(
            f"model.path={shown!r} has no weights (no *.safetensors or pytorch_model*.bin file in it{where}); copy "
            f"the model's weight files into it{gguf_fix}"
        )
    return directory


def _check_config(config_json: Path, shown: str) -> None:
    """config.json is a JSON object naming the model's architecture (model_type, or its own code's auto_map)."""
    from transformers import CONFIG_MAPPING, __version__

    fix = "copy the model's config.json again from where the model came from"
    text = config_json.read_bytes().decode("utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"model.path={shown!r}: its config.json is empty; {fix}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"model.path={shown!r}: its config.json is not valid JSON ({err.msg} at line {err.lineno}, column "
            f"{err.colno}); {fix}"
        ) from err
    if not isinstance(config, dict):
        raise ValueError(
            f"model.path={shown!r}: its config.json holds a JSON {type(config).__name__}, not an object of settings; "
            f"{fix}"
        )
    own_code = "AutoConfig" in (config.get("auto_map") or {})  # the model's own configuration class
    model_type = config.get("model_type")
    if not model_type and not own_code:
        raise ValueError(
            f"model.path={shown!r}: its config.json has no model_type, so the model's architecture is unknown; {fix}"
        )
    if model_type and not own_code and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model.path={shown!r}: its config.json names model_type {model_type!r}, an architecture transformers "
            f"{__version__} does not know; install a transformers that does (pip install -U transformers), or "
            "check the model_type"
        )


def check_tokenizer(tokenizer, directory: Path, shown: str) -> None:
    """A tokenizer read from ``directory`` has a vocabulary: without its files transformers still builds one of the
    config's class, holding a token or two, and generation fails later far from the cause."""
    try:
        size = tokenizer.vocab_size
    except NotImplementedError:  # a tokenizer of the model's own code may not say
        return
    if size > 1:
        return
    raise no_tokenizer(directory, shown)


def tokenizer_files(directory: Path) -> list[str]:
    """The names of the files in ``directory`` a tokenizer could be read from."""
    return sorted(p.name for p in directory.iterdir() if any(part in p.name.lower() for part in TOKENIZER_NAME_PARTS))


def no_tokenizer(directory: Path, shown: str) -> FileNotFoundError:
    """The one-line error for a model directory whose tokenizer cannot be read: which files it has and the fix."""
    found = ", ".join(tokenizer_files(directory)) or "none"
    return FileNotFoundError(
        f"model.path={shown!r} has no tokenizer (tokenizer files in it: {found}); copy the model's tokenizer files "
        "(tokenizer.json and tokenizer_config.json, or the vocabulary files its tokenizer reads) into it from where "
        "the model came from"
    )
