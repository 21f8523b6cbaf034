"""The exceptions a user sees: a message that names the file, key or value at fault.

The CLI prints a `JaxtuneError` as a single line (no traceback) and exits with status 2; notebooks get a normal
exception. A `ConfigError` is also a `ValueError`, so code that validated configs with `except ValueError` still
works; its message starts with the field, and the TOML loader puts the section in front (`method.rank = 0: ...`).
A `JaxtuneWarning` is Python's warning in a notebook and one line, `jaxtune: warning: ...`, from the CLI.
`check_choice` and `check_range` are the validators the config dataclasses call.
"""

import json


class JaxtuneError(Exception):
    """A problem with the user's input (files, configs, shapes), explained in one line."""


class JaxtuneWarning(UserWarning):
    """Something the user should know that does not stop the run (e.g. a setting slower than another here)."""


class ConfigError(JaxtuneError, ValueError):
    """A config value outside what its field accepts: `field = value: what is valid`."""

    def __init__(self, field: str, value, valid: str):
        self.field, self.value, self.valid = field, value, valid
        super().__init__(f"{field} = {_shown(value)}: {valid}")

    def in_section(self, section: str) -> "ConfigError":
        """The same error with its field qualified by a config section, e.g. `rank` -> `method.rank`."""
        return ConfigError(f"{section}.{self.field}", self.value, self.valid)


def _shown(value) -> str:
    """A value as a config file writes it (TOML/JSON: true, "text", [1, 2])."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_choice(field: str, value, choices) -> None:
    """Raise a ConfigError unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(field, value, "choose one of " + ", ".join(str(c) for c in choices))


def check_range(field: str, value, low=None, high=None, *, low_open=False, high_open=False) -> None:
    """Raise a ConfigError unless low <(=) value <(=) high (either bound may be None); NaN is always out."""
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above or value != value:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        if low is not None and high is not None:
            raise ConfigError(field, value, f"must be in {lo}, {hi}")
        raise ConfigError(field, value, f"must be {'>' if low_open else '>='} {low}" if low is not None
                          else f"must be {'<' if high_open else '<='} {high}")
