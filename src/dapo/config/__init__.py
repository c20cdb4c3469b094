"""One typed config tree. Every default lives in ``schema``, with a comment; YAML presets hold overrides only.

    cfg = load_config("configs/demo.yaml", ["algo.eps_high=0.28", "rollout.backend=hf"])

Unknown keys, wrong types and inconsistent values fail at start with a ConfigError naming the key and the fix.
``schema``: the tree; ``declare``: how a setting is declared (its ``Rule``, ``field``); ``read``: presets and
overrides into it; ``rules``: the checks, each setting's own and those between settings; ``shipped``: where the
shipped presets, models and data are. This
package imports nothing else of dapo: every other stage reads its settings from here.
"""

from dapo.config.read import (
    PRESET_DIR,
    REPLACED,
    config_from_dict,
    dotted_to_nested,
    dump_yaml,
    load_config,
    merge,
    preset_names,
    read_preset,
    resolve_preset,
    to_dict,
)
from dapo.config.rules import ASYNC_IS_CAP, RULES, settings, validate
from dapo.config.schema import (
    LORA_DEFAULT_TARGETS,
    AlgoConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LoraConfig,
    MlflowConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TeacherConfig,
    ToolsConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "ASYNC_IS_CAP",
    "LORA_DEFAULT_TARGETS",
    "PRESET_DIR",
    "REPLACED",
    "RULES",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoraConfig",
    "MlflowConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TeacherConfig",
    "ToolsConfig",
    "TrainConfig",
    "WandbConfig",
    "config_from_dict",
    "dotted_to_nested",
    "dump_yaml",
    "load_config",
    "merge",
    "preset_names",
    "read_preset",
    "resolve_preset",
    "settings",
    "to_dict",
    "validate",
]
