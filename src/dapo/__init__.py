"""dapo: Decoupled Clip and Dynamic sAmpling Policy Optimization for language models.

The Python API (``dapo.api``; the README's "Python API" has an example):

    from dapo import Config, load_config, train, evaluate

The names load on first use, so ``import dapo`` stays light (no torch until ``train`` or
``evaluate`` is touched). The modules behind them are ``dapo.training`` and ``dapo.evaluation``,
named apart from the functions: importing a submodule sets the package attribute of its name, which
would otherwise replace ``dapo.train`` with a module.
"""

import importlib as _importlib

from dapo.runtime.threads import wait_briefly as _wait_briefly

_wait_briefly()  # before torch loads its OpenMP runtime: threads that wait soon sleep (dapo.runtime.threads)

__version__ = "0.1.0"

_API = {
    "Config": "dapo.config",
    "ConfigError": "dapo.config",
    "load_config": "dapo.config",
    "train": "dapo.api",
    "evaluate": "dapo.api",
    "TrainResult": "dapo.api",
    "EvalResult": "dapo.evaluation",
    "RewardFnError": "dapo.rewards",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'dapo' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_API[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
