"""The run configuration: schema, loading and validation.

Kept free of torch and the other heavy layers so the CLI, the client and Temporal workflow
code can import it cheaply; the schema's registry checks import `ratchet.algorithms` only
while validating.
"""

from ratchet.config.loader import ConfigError, config_to_yaml, load_config, validate_config
from ratchet.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "config_to_yaml", "load_config", "validate_config"]
