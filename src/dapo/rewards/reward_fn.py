"""A user's reward function `(response, ground_truth) -> score | (score, correct)` on its way to the pool.

It reaches the grading workers pickled, that is by module and name, so it must be defined at the top
level of a module; one defined in the caller's main script is found by running that script again in
the worker as `__mp_main__`, as multiprocessing's spawn does (its `if __name__ == "__main__":` block
does not run). reward.function names one instead, as MODULE:FUNCTION: ``ImportedRewardFn`` reaches the workers
as that name, and each imports it itself.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import io
import math
import numbers
import os
import pickle
import re
import sys
import traceback
import types
from collections.abc import Callable, Container, Mapping
from multiprocessing import spawn
from pathlib import Path

from dapo.config import ConfigError

REWARD_FN = "reward_fn"  # the grader name of a reward function given to dapo.train or dapo.evaluate
REWARD_FUNCTION = "reward.function"  # the grader name of the function reward.function names


class RewardFnError(TypeError):
    """A reward function that cannot be sent to the workers, or that returned something unusable."""


class _MainReferences(pickle.Pickler):
    """A pickler that notes whether the object refers to anything defined in ``__main__``."""

    uses_main = False

    def persistent_id(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            self.uses_main = True
        return None


def _main_script(name: str) -> dict:
    """What a worker needs to run the caller's main script again (multiprocessing's own description)."""
    data = spawn.get_preparation_data("dapo-reward-worker")
    main = {k: data[k] for k in ("sys_path", "init_main_from_name", "init_main_from_path") if k in data}
    module = main.get("init_main_from_name", "")
    if "init_main_from_path" not in main and (not module or module == "__main__" or module.endswith(".__main__")):
        raise RewardFnError(
            f"{name} is defined in an interactive session or a package's __main__, which the "
            "reward workers cannot import; define it in a .py file and import it from there"
        )
    return main


def pickle_reward_fn(name: str, fn) -> tuple[bytes, dict]:
    """``fn`` as the workers receive it: its pickle, and what ``multiprocessing.spawn.prepare`` needs
    there to unpickle it: the caller's sys.path, and its main script when ``fn`` lives in it."""
    if not callable(fn):
        raise RewardFnError(f"{name}={fn!r} is not callable; give a function (response, ground_truth) -> score")
    buffer = io.BytesIO()
    pickler = _MainReferences(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        what = getattr(fn, "__qualname__", type(fn).__name__)
        raise RewardFnError(
            f"{name}={what} cannot be sent to the reward worker processes ({err}); define it with "
            "def at the top level of a module or of your script (not a lambda, closure or nested "
            "function)"
        ) from None
    return buffer.getvalue(), _main_script(name) if pickler.uses_main else {"sys_path": list(sys.path)}


def pickle_reward_fns(
    reward_fns: Mapping[str, Callable] | None, taken: Container[str]
) -> tuple[dict[str, bytes], dict]:
    """Each function pickled for the workers, and what they need to unpickle them all; `taken`: the
    names of the other graders."""
    blobs: dict[str, bytes] = {}
    main: dict = {}
    for name, fn in (reward_fns or {}).items():
        if not isinstance(name, str) or not name or name in taken:
            raise ValueError(f"reward function name {name!r}: must be a new, non-empty name")
        blobs[name], fn_main = pickle_reward_fn(name, fn)
        main = fn_main if len(fn_main) > len(main) else main  # one that names the main script covers all
    return blobs, main


def _check_score(name: str, out) -> tuple[float, bool]:
    """A reward function's return value as (score, correct): a number (correct when > 0), or
    (score, correct) with correct a bool."""

    def number(x) -> bool:  # numpy's scalars count (they register as numbers.Real); a bool is not a score
        return isinstance(x, numbers.Real) and type(x).__name__ not in ("bool", "bool_")

    if number(out):
        score, correct = float(out), float(out) > 0
    elif isinstance(out, tuple) and len(out) == 2 and number(out[0]) and type(out[1]).__name__ in ("bool", "bool_"):
        score, correct = float(out[0]), bool(out[1])
    else:
        raise RewardFnError(
            f"{name} returned {out!r:.80} ({type(out).__name__}); return a float score, or a "
            "tuple (score, correct) with correct a bool"
        )
    if not math.isfinite(score):
        raise RewardFnError(f"{name} returned the score {score}; return a finite number")
    return score, correct


def _as_grader(name: str, fn) -> Callable[[str, str], tuple[float, bool, str]]:
    def grade(response: str, ground_truth: str) -> tuple[float, bool, str]:
        score, correct = _check_score(name, fn(response, ground_truth))
        # the response's last line stands for its answer: maj@n votes on it, samples/ show it
        lines = response.strip().splitlines()
        return score, correct, lines[-1].strip()[:100] if lines else ""

    return grade


def load_reward_fns(reward_fns: dict[str, bytes], main: dict) -> dict:
    """In a worker: the pickled functions as graders (response, truth) -> (score, acc, pred)."""
    spawn.prepare(main)  # the caller's sys.path; with a main script, runs it as __mp_main__, made __main__ here
    return {name: _as_grader(name, pickle.loads(blob)) for name, blob in reward_fns.items()}


def grader_name(reward_fn) -> str:
    """The grader name a reward function grades under: REWARD_FUNCTION for reward.function's, else REWARD_FN."""
    return REWARD_FUNCTION if isinstance(reward_fn, ImportedRewardFn) else REWARD_FN


def reward_function(spec: str, probe_truth: str = "1") -> ImportedRewardFn:
    """The function reward.function names ("my_rewards:reward", "rewards/mine.py:reward"), imported here and
    tried once on the response "Answer: <probe_truth>": a ConfigError naming reward.function and the fix for a
    module or file that is missing or fails to import, a name that is no function, or a function that raises
    or returns no score."""
    fn = ImportedRewardFn(spec)
    response = f"Answer: {probe_truth}"
    try:
        out = fn(response, probe_truth)
    except Exception as err:
        raise _setting_error(
            f"reward.function={spec} raised {type(err).__name__}: {err} on the response {response!r} (ground "
            f"truth {probe_truth!r}); it must return a score for any response"
        ) from None
    try:
        _check_score(f"reward.function={spec}", out)
    except RewardFnError as err:
        raise _setting_error(str(err)) from None
    return fn


class ImportedRewardFn:
    """reward.function's function. It reaches the grading workers as its name, and each imports it itself (as
    every rank of torchrun or Ray that grades does, from its config): a module by name, from sys.path (then the
    current directory), or a .py file by its absolute path."""

    def __init__(self, spec: str, where: str | None = None):
        self.spec = spec
        module, _, name = spec.rpartition(":")
        self.where = where or _where(module)
        self.fn = getattr(_module(self.where, module, spec), name, None)
        if self.fn is None:
            raise _setting_error(
                f"reward.function={spec}: {module} has no function {name!r}{_functions(self.where, name)}"
            )
        if not callable(self.fn):
            raise _setting_error(
                f"reward.function={spec}: {module}'s {name} is a {type(self.fn).__name__}, not a function; name a "
                "function (response, ground_truth) -> score"
            )

    def __call__(self, response: str, ground_truth: str):
        return self.fn(response, ground_truth)

    def __reduce__(self):
        return ImportedRewardFn, (self.spec, self.where)


def _setting_error(message: str) -> Exception:
    """A ConfigError: a bad reward.function is a bad setting (``dapo`` says it in one line)."""
    return ConfigError(message)


def _is_file(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _where(module: str) -> str:
    """How every process finds MODULE: a file by its absolute path (the current directory may differ there)."""
    return str(Path(module).expanduser().resolve()) if _is_file(module) else module


_FILE_MODULES: dict[str, types.ModuleType] = {}  # .py files imported by path, each once per process


def _module(where: str, given: str, spec: str) -> types.ModuleType:
    importlib.invalidate_caches()  # a module written since this process last looked
    if not _is_file(where):
        return _import_by_name(where, spec)
    if where in _FILE_MODULES:
        return _FILE_MODULES[where]
    if not os.path.isfile(where):
        raise _setting_error(
            f"reward.function={spec}: no such file {given} (in {os.getcwd()}); give the path of a .py file, or an "
            "importable module's name"
        )
    name = f"dapo_reward_function_{len(_FILE_MODULES)}_{re.sub(r'[^0-9a-zA-Z_]', '_', Path(where).stem)}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, where))
    sys.modules[name] = module  # as an import would: dataclasses and pickle look a class's module up there
    folder = str(Path(where).parent)
    if folder not in sys.path:  # the modules beside it import as they do when it runs as a script (last: no shadowing)
        sys.path.append(folder)
    try:
        module.__spec__.loader.exec_module(module)
    except (Exception, SystemExit) as err:
        del sys.modules[name]
        raise _import_failed(spec, given, where, err) from None
    _FILE_MODULES[where] = module
    return module


def _import_by_name(name: str, spec: str) -> types.ModuleType:
    top = name.partition(".")[0]
    try:
        if importlib.util.find_spec(top) is None and importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]):
            sys.path.append(os.getcwd())  # in the current directory, as `python -m` finds it (last: shadows nothing)
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise _setting_error(
                f"reward.function={spec}: no module named {name!r} on sys.path or in the current directory "
                f"({os.getcwd()}); give an importable module's name, or the path of its .py file "
                f"(reward.function=path/to/{name.rpartition('.')[2]}.py:{spec.rpartition(':')[2]})"
            ) from None
        raise _import_failed(spec, name, None, err) from None  # found, but it imports a module that is missing
    except (Exception, SystemExit) as err:
        raise _import_failed(spec, name, None, err) from None


def _import_failed(spec: str, given: str, path: str | None, err: BaseException) -> Exception:
    """One line for a module that raised while it was imported, with the line that raised: the module's own last
    line in the traceback (``path``: its file, named as given; None: imported by name, the first file it ran)."""
    if isinstance(err, SyntaxError):
        filename, line, what = err.filename, err.lineno, f"SyntaxError: {err.msg}"
    else:
        machinery = (__file__, os.path.dirname(importlib.__file__))  # frames of the import itself, not the module's
        frames = [
            f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(("<frozen", *machinery))
        ]
        mine = [f for f in frames if f.filename == (path or frames[0].filename)]
        filename, line = (mine[-1].filename, mine[-1].lineno) if mine else (None, None)
        what = f"{type(err).__name__}: {err}"
    at = f" ({given if path is not None and filename == path else filename}, line {line})" if filename else ""
    return _setting_error(f"reward.function={spec}: importing {given} failed: {what}{at}; fix the module")


def _functions(where: str, name: str) -> str:
    """What to say of a function ``name`` the (imported) module lacks: "; did you mean reward? (its functions: ...)"."""
    module = _FILE_MODULES.get(where) or sys.modules.get(where)
    if module is None:
        return ""
    names = sorted(
        n
        for n, v in vars(module).items()
        if isinstance(v, types.FunctionType) and not n.startswith("_") and v.__module__ == module.__name__
    )
    if not names:
        return "; it defines no function"
    close = difflib.get_close_matches(name, names, n=1)
    return (f"; did you mean {close[0]}?" if close else "") + f" (its functions: {', '.join(names)})"
