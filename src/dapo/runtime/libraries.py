"""The libraries underneath (vLLM, Ray, transformers, torch.distributed): their logging, and their errors.

They log to ``<run>/train.log`` at INFO (``setup_library_logging``); the console shows their warnings only, less
the ones listed in ``HARMLESS`` that this project's own settings provoke on purpose (``run.log_level`` and
``--verbose`` bring the rest back). ``raised_outside`` tells an error of theirs from one of this package's.
Where the run's metrics go is ``dapo.reporting.run_log``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

from dapo.config import ConfigError

# vLLM installs its own stdout handler when imported unless told not to: its records then reach
# the handlers below like every other library's (rollout/vllm.py imports vLLM after this module)
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

LIBRARIES = ("vllm", "ray", "transformers", "torch", "py.warnings", "mlflow", "alembic")
LEVELS = ("debug", "info", "warning", "error")
# (logger name prefix, start of the message, why it is harmless). Each is provoked by a setting the
# project chooses on purpose, so the console leaves them out; train.log keeps them.
HARMLESS = (
    (
        "vllm",
        "Chat template warmup failed",
        "skip_tokenizer_init=True: prompts arrive as token ids from the trainer's tokenizer; vLLM renders no chat",
    ),
    (
        "vllm",
        "Using None for EOS token id",
        "skip_tokenizer_init=True: every request names its stop tokens (stop_token_ids)",
    ),
    (
        "vllm",
        "The global random seed is set to",
        "the rollout engine restores the trainer's random state around every vLLM call (preserved_rng)",
    ),
    (
        "vllm",
        "This model does not officially support disabling chunked prefill",
        "on CPU every prompt is prefilled whole so seeded samples stay reproducible (_whole_prefill_settings)",
    ),
    ("vllm", "Enforce eager set", "on CPU the engine runs eagerly (enforce_eager): nothing to compile"),
    ("vllm", "Inductor compilation was disabled", "as above"),
    ("vllm", "Triton is", "no Triton on CPU: vLLM uses its native CPU kernels"),
    ("vllm", "Model Runner V2 requires Triton", "as above"),
    ("vllm", "Reset SSM cache type", "concerns state-space (Mamba) models only"),
    ("vllm", "libtcmalloc is not found", "a speed hint for CPU serving; sampling is correct without it"),
    ("vllm", "libiomp is not found", "as above"),
    (
        "vllm",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        "the thread count is set before the engine is built (rollout/vllm.py)",
    ),
    # (matched by category, in _ConsoleFilter)
    ("py.warnings", "", "deprecation notices inside the libraries (FutureWarning, DeprecationWarning)"),
)
_TAG = "_dapo_handler"


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":  # a library's deprecation notice, not the user's to act on
            text = str(record.args[0]) if record.args else record.getMessage()
            return "FutureWarning" not in text and "DeprecationWarning" not in text
        message = record.getMessage()
        return not any(
            prefix and message.startswith(prefix) and (record.name + ".").startswith(name + ".")
            for name, prefix, _ in HARMLESS
        )


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record comes (a captured or replaced stream included)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def verbose() -> bool:
    """``--verbose`` on the command line (kept in the environment, so worker processes see it too)."""
    return os.environ.get("DAPO_VERBOSE", "") not in ("", "0")


def close_library_logging() -> None:
    """Take away the handlers ``setup_library_logging`` installed (and close the run's log file)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, _TAG, False)]:
        root.removeHandler(h)
        h.close()


def route_library_logger(name: str) -> None:
    """Hand a library's log records to the handlers ``setup_library_logging`` installs (train.log, the
    console's warnings) instead of the stream handlers it printed through; for libraries imported
    after the run started (the trackers: MLflow configures its logger when imported)."""
    lg = logging.getLogger(name)
    for h in lg.handlers[:]:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            lg.removeHandler(h)
    lg.propagate = True


def rank_log_path(run_dir: Path, rank: int = 0) -> Path:
    """The rank's log file: ``train.log`` for rank 0, ``train.rank<k>.log`` for the others."""
    return Path(run_dir) / ("train.log" if rank == 0 else f"train.rank{rank}.log")


def raised_outside(err: BaseException) -> bool:
    """Whether ``err`` was raised outside this package (an engine, a CUDA call), so that its own message says
    nothing of where the run was; this package's errors already say what to change."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # the frame that raised it
    return tb is None or tb.tb_frame.f_globals.get("__name__", "").split(".")[0] != "dapo"


def setup_library_logging(
    run_dir: Path | None = None, console_level: str = "warning", *, rank: int = 0, transformers: bool = True
) -> Path | None:
    """Route the libraries' logging: everything at INFO and above to ``<run_dir>/train.log`` (other ranks
    than 0: ``train.rank<k>.log``), and to the console (stderr) what reaches ``console_level``, less
    the messages of ``HARMLESS``. With ``--verbose`` the console shows INFO and everything. Calling it
    again replaces what an earlier call installed. Returns the log file. ``transformers=False``: a process that
    never loads a model (``dapo launch-ray``'s driver) leaves transformers unimported (1.3 CPU seconds)."""
    if console_level.lower() not in LEVELS:
        raise ConfigError(f"run.log_level={console_level!r}: choose one of {', '.join(LEVELS)}")
    level = logging.INFO if verbose() else getattr(logging, console_level.upper())
    close_library_logging()
    root = logging.getLogger()
    # libraries that print through handlers of their own (torch, transformers, vLLM if configured)
    # hand their records to the root logger instead
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and name.split(".")[0] in LIBRARIES:
            route_library_logger(name)
    if transformers:
        with contextlib.suppress(ImportError):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_default_handler()
            hf_logging.enable_propagation()
    for name in ("vllm", "ray", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(min(logging.INFO, level))
    root.setLevel(min(logging.INFO, level))
    logging.captureWarnings(True)
    console = _Stderr()
    console.setLevel(level)
    console.setFormatter(logging.Formatter("%(levelname)s (%(name)s): %(message)s"))
    if not verbose():
        console.addFilter(_ConsoleFilter())
    setattr(console, _TAG, True)
    root.addHandler(console)
    if run_dir is None:
        return None
    path = rank_log_path(run_dir, rank)
    file = logging.FileHandler(path, encoding="utf-8")
    file.setLevel(min(logging.INFO, level))
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    setattr(file, _TAG, True)
    root.addHandler(file)
    # `dapo ablate` sends each run's console to its train.log: the file has the warnings already (the suppressed
    # errors: a stderr without a file, captured or closed)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        if os.path.samestat(os.fstat(sys.stderr.fileno()), os.stat(path)):
            root.removeHandler(console)
    return path
