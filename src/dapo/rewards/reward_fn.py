"""A user's reward function `(response, ground_truth) -> score | (score, correct)` on its way to the pool.

It reaches the grading workers pickled, that is by module and name, so it must be defined at the top
level of a module; one defined in the caller's main script is found by running that script again in
the worker as `__mp_main__`, as multiprocessing's spawn does (its `if __name__ == "__main__":` block
does not run).
"""

from __future__ import annotations

import io
import math
import numbers
import pickle
import sys
import types
from collections.abc import Callable, Container, Mapping
from multiprocessing import spawn

REWARD_FN = "reward_fn"  # the grader name of a reward function given to dapo.train or dapo.evaluate


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
