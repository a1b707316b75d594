"""Configuration: schema, loading with overrides, and validation against the feature registry."""

from megatron_rl.config.loader import config_text, load_config, to_yaml  # noqa: F401
from megatron_rl.config.schema import Config  # noqa: F401
from megatron_rl.errors import ConfigError, UserInputError  # noqa: F401
