"""Config errors that name the full key path, the bad value and what was expected."""
from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or override that cannot be used. ``key`` is the dotted path (e.g. trainer.steps)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


class ConfigValueError(ValueError):
    """Raised by a section's ``validate()``; the loader adds the section to the key path."""

    def __init__(self, field: str, value, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{field}={value!r}: expected {expected}")


def invalid_value(key: str, value, expected: str) -> ConfigError:
    return ConfigError(key, f"invalid value for config key '{key}': got {value!r}, expected {expected}")
