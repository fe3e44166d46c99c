"""Error types shared by every stage.

Every user-facing error is a list of :class:`Problem` records: where the problem is (a config field
path, a tensor name, a file), what was found, what was expected, and how to fix it. Stages collect
all problems they can find before raising, so one run reports everything that is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input."""

    where: str
    found: str
    expected: str
    fix: str

    def render(self) -> str:
        return f"{self.where}: found {self.found}; expected {self.expected}. Fix: {self.fix}"


class DFlashError(Exception):
    """Base class of every error this package raises on purpose."""


class InputError(DFlashError):
    """The user's input (config, checkpoint, options) is invalid; carries every problem found."""

    def __init__(self, subject: str, problems: Iterable[Problem]) -> None:
        self.subject = subject
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("InputError needs at least one problem")
        lines = [f"{subject}: {len(self.problems)} problem(s)"]
        lines += [f"  - {p.render()}" for p in self.problems]
        super().__init__("\n".join(lines))


class ConfigError(InputError):
    """A drafter or target config.json is invalid."""


class WeightsError(InputError):
    """A checkpoint's tensors do not match what the config requires."""


def short(value: object, limit: int = 60) -> str:
    """A compact repr of a found value for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
