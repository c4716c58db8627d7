"""The one config: typed dataclasses (sections.py), loaded from TOML and overridable as
`--section.key=value` (loading.py), every key checked before any process starts with one line
naming the fix (validation.py: each numeric key's range, then the rules between keys).
"""

from tetrad.config.loading import check_override, load_config, read_toml, split_config_args
from tetrad.config.sections import (COMM_GROUPS, COMM_OPTIONS, DEFAULT_BUCKET_MB, SECTIONS, CheckpointConfig, Config, ConfigError, DataConfig,
                                    ModelConfig, ParallelConfig, RunConfig, TrainConfig)
from tetrad.config.validation import RANGES, idle_settings, profile_steps, validate, validate_device
from tetrad.config.wording import counted

__all__ = ["COMM_GROUPS", "COMM_OPTIONS", "DEFAULT_BUCKET_MB", "RANGES", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "idle_settings",
           "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig", "check_override", "counted", "load_config", "profile_steps",
           "read_toml", "split_config_args", "validate", "validate_device"]
