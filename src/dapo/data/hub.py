"""Hugging Face datasets as data: a dataset id on the Hub (``openai/gsm8k:main:train``), a ``save_to_disk`` folder
or a ``datasets.Dataset`` given in Python, read through the ``datasets`` library (``pip install 'dapo[datasets]'``),
imported only here and only when one is named.

A dataset id is ``ORG/NAME[:CONFIG[:SPLIT]]``. It loads as ``datasets.load_dataset`` loads it, from its cache
(HF_DATASETS_CACHE) or the Hub; without the Hub (HF_HUB_OFFLINE=1, or no network) a copy that ``hf download
--repo-type dataset`` put in the Hugging Face cache (HF_HUB_CACHE) is read instead. Without a split the role's is
taken (train for training, test for evaluation), or the only one there is.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from dapo.data.layouts import DataError

# ORG/NAME, then an optional :CONFIG and :SPLIT (an empty CONFIG is the default one: openai/gsm8k::test is wrong,
# HuggingFaceH4/MATH-500::test is its default config's test split)
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<config>[\w.-]*))?(?::(?P<split>[\w.-]+))?$")
_FILE_LIKE = re.compile(r"\.(jsonl|json|parquet|gz|csv|tsv|txt|arrow|yaml)$", re.IGNORECASE)
INSTALL = "pip install 'dapo[datasets]'"


def is_dataset_id(spec: str) -> bool:
    """Whether ``spec`` is spelled as a Hub dataset id. A missing local file named like one is not, nor a missing
    path under a folder that is here (data/mine: a path mistyped, not the Hub's "data" organisation)."""
    found = _ID.match(spec)
    if found is None or _FILE_LIKE.search(found["repo"]):
        return False
    return not Path(found["repo"]).parent.is_dir()


def dataset_id(spec: str) -> str:
    """ORG/NAME of ``spec``: what names its rows (and picks their grader) under reward.grader=auto."""
    return _ID.match(spec)["repo"]


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: reading a Hugging Face dataset needs the datasets library: {INSTALL}") from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets):
    """The library without its progress bars and its notes ("Using the latest cached version ..."): the run says
    what it read, in its start line."""
    level, bars = datasets.logging.get_verbosity(), datasets.utils.is_progress_bar_enabled()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def hub_rows(spec: str, split: str) -> Iterator[dict]:
    """The rows of dataset id ``spec`` (its own split, else ``split``); a dataset that cannot be had is one line
    naming the fix."""
    datasets = _datasets(spec)
    found = _ID.match(spec)
    repo, config = found["repo"], found["config"] or None
    with _quiet(datasets):
        try:
            loaded = datasets.load_dataset(repo, config)
        except ConnectionError:  # offline, or no network: a copy `hf download` left in the hub cache
            snapshot = _cached_snapshot(repo)
            if snapshot is None:
                raise DataError(_not_cached(spec, repo, config)) from None
            loaded = _load(datasets, spec, str(snapshot), config)
        except datasets.exceptions.DatasetNotFoundError as err:
            raise DataError(
                f"{spec}: {err}; check the id (ORG/NAME[:CONFIG[:SPLIT]]), and for a gated or private dataset log in "
                "(`hf auth login`)"
            ) from None
        except ValueError as err:  # a config missing or unknown: the library lists the ones there are
            raise DataError(_config_error(spec, repo, err)) from None
    return dataset_rows(_split_of(loaded, found["split"] or split, spec))


def _load(datasets, spec: str, path: str, config: str | None):
    try:
        return datasets.load_dataset(path, config)
    except ValueError as err:
        raise DataError(_config_error(spec, dataset_id(spec), err)) from None


def _config_error(spec: str, repo: str, err: Exception) -> str:
    said = " ".join(str(err).split())
    return f"{spec}: {said}; give the config as {repo}:CONFIG (and the split as {repo}:CONFIG:SPLIT)"


def _cached_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache without refs
        return None


def _not_cached(spec: str, repo: str, config: str | None) -> str:
    from huggingface_hub import constants

    datasets = _datasets(spec)
    offline = "HF_HUB_OFFLINE=1 is set" if datasets.config.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
    load = f"datasets.load_dataset('{repo}'" + (f", '{config}')" if config else ")")
    return (
        f"{spec}: {offline} and neither the datasets cache ({datasets.config.HF_DATASETS_CACHE}) nor the Hugging "
        f'Face cache ({constants.HF_HUB_CACHE}) holds it; load it once where there is network (python -c "import '
        f'datasets; {load}", or `hf download --repo-type dataset {repo}`) and copy that cache here (or point '
        "HF_DATASETS_CACHE or HF_HUB_CACHE at it), or give a local file"
    )


def _split_of(loaded, split: str, spec: str):
    """One split of a DatasetDict (``split``, or the only one), or the Dataset itself."""
    if not hasattr(loaded, "keys"):
        return loaded
    names = list(loaded.keys())
    if split in names:
        return loaded[split]
    if len(names) == 1:
        return loaded[names[0]]
    raise DataError(f"{spec}: no split {split!r}; it has {', '.join(names)}: name one, e.g. {spec}:{names[0]}")


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    saved_dataset = (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    return saved_dataset or (path / "dataset_dict.json").is_file()


def saved_rows(path: Path, split: str) -> tuple[Iterator[dict], tuple[str, str] | None]:
    """The rows of a ``save_to_disk`` folder (its ``split`` where it holds several), and its data set's name."""
    datasets = _datasets(str(path))
    with _quiet(datasets):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:  # the library raises several types for a broken folder
            raise DataError(f"{path}: not a readable save_to_disk folder ({err}); save it again") from None
    ds = _split_of(loaded, split, str(path))
    return dataset_rows(ds), dataset_named(ds)


def is_dataset(obj) -> bool:
    """Whether ``obj`` is one of the datasets library's data sets (without importing it)."""
    return any(c.__module__.startswith("datasets.") for c in type(obj).__mro__[:-1])


def dataset_named(ds) -> tuple[str, str] | None:
    """("dataset's name", its name) for a Dataset the library knows the name of (one loaded from the Hub), else None."""
    name = getattr(getattr(ds, "info", None), "dataset_name", None)
    return ("dataset's name", name) if name else None


def dataset_rows(ds, name: str = "data") -> Iterator[dict]:
    """A Dataset's rows as dicts, a batch of Arrow records at a time."""
    if hasattr(ds, "keys"):
        splits = ", ".join(ds.keys())
        raise DataError(f"{name}: a DatasetDict of the splits {splits}: give one of them, e.g. data['train']")
    if not hasattr(ds, "with_format"):  # an IterableDataset: its rows as they come
        return iter(ds)
    return (row for batch in ds.with_format("arrow").iter(batch_size=4096) for row in batch.to_pylist())
