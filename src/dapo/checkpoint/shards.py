"""Sharded checkpoints: each rank writes its shards of the weights and AdamW state (torch.distributed.checkpoint),
and any number of ranks, or one plain process, reads them back resharded. Nothing is unpickled beyond plain data:
a crafted index or entry is refused before it can run code (``_safe_dcp_loaders``)."""

from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path

import torch

from dapo.runtime.files import CheckpointError


def save_shards(state: dict, path) -> None:
    """Collective: each rank writes its shards, rank 0 the index (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path))


# What a torch.distributed.checkpoint index (shards/.metadata) is made of. Its reader in torch uses plain
# pickle, so a crafted index could call anything (os.system) while loading; this list is all it may name.
_DCP_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # which file and bytes hold each entry
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and friends, looked up by name
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.where}: names {module}.{name}, which is not checkpoint metadata; refused "
            "without running it (a crafted or foreign file): use only checkpoints you wrote"
        )


def _safe_dcp_loaders(path: Path, *, whole: bool = False):
    """torch.distributed.checkpoint's file reader and load planner, minus their two plain-pickle loads:
    the index goes through the allow-list above, non-tensor entries (the optimizer's param_groups)
    through torch.load(weights_only=True), like the tensors already are. ``whole``: the planner builds
    the state dict from the index (every entry at its full size) instead of filling a given one."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            file = Path(self._get_metadata_path(kwargs.get("rank")))
            try:
                with self.fs.create_stream(file, "rb") as f:
                    metadata = _MetadataUnpickler(f, file).load()
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                raise CheckpointError(
                    f"{file}: unreadable ({type(err).__name__}: {err}); the checkpoint is "
                    "incomplete or damaged: delete its step directory or use another"
                ) from None
            if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
                raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not a checkpoint index")
            for info in metadata.storage_data.values():
                # entries are read from files named relative to shards/: never elsewhere (../, /etc/...)
                name = getattr(info, "relative_path", None)
                if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
                    raise CheckpointError(f"{file}: points an entry at {name!r}, outside the shards directory; refused")
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner if whole else DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as err:
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CheckpointError(
                    f"{path}: entry {fqn!r} needs more than plain data to load ({why}); refused "
                    "without running it (a crafted or foreign file): use only checkpoints you wrote"
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Reader(path), Planner()


def load_shards(state: dict, path) -> None:
    """Fill ``state`` in place from shards written by any number of ranks (resharded as needed);
    works in a plain process too (the export). Loads no code: see ``_safe_dcp_loaders``."""
    import torch.distributed.checkpoint as dcp

    reader, planner = _safe_dcp_loaders(Path(path))
    reader.read_metadata()  # here first, so that every rank fails with the reason rather than a wrapped report
    with _own_errors():
        dcp.load(state, storage_reader=reader, planner=planner)


@contextlib.contextmanager
def _own_errors():
    """A CheckpointError of ours raised as itself, not inside the report in which torch gathers every
    rank's failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        ours = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def read_shards(path) -> dict:
    """The whole state a sharded checkpoint holds (every rank's shards joined, as plain tensors), read in
    this process alone: how a checkpoint of N ranks resumes in one process. Loads no code, as ``load_shards``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, planner = _safe_dcp_loaders(Path(path), whole=True)
    reader.read_metadata()  # the reason first, as in load_shards
    state: dict = {}
    with _own_errors(), warnings.catch_warnings():  # one process is the intent: torch's warning says it assumes so
        warnings.simplefilter("ignore", UserWarning)
        # as torch's own dcp_to_torch_save reads a whole checkpoint (dcp.load would fill a copy of the dict)
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    return state
