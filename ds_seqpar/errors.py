"""The package's exceptions, in a leaf that imports nothing of the package.

Every layer raises them: the strategy and kernel registries refuse an unknown name with a
ConfigError, and config.py imports those registries to list the valid names, so the exceptions
cannot live in config.py without an import circle. ``ds_seqpar.ConfigError``,
``ds_seqpar.config.ConfigError`` and ``ds_seqpar.hf.UnsupportedModelError`` re-export these classes.
"""


class ConfigError(ValueError):
    """A bad ``sequence_parallel`` setting; the message names key, value and the valid choices."""


class UnsupportedModelError(ConfigError):
    """A model feature that cannot be exact under sequence parallelism (same message on every rank)."""


__all__ = ["ConfigError", "UnsupportedModelError"]
