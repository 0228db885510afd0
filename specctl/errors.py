"""The SpecctlError hierarchy: every error a user can cause names the problem and the fix.

The CLI (``specctl.cli.main``) turns these into one line on stderr and an exit code: 1 for a
problem with the input or the environment, 2 for a usage error. Code that raises one of these
never prints; it only describes.
"""

from __future__ import annotations


class SpecctlError(Exception):
    """Base class. ``str(err)`` is the one line shown to the user: the problem, then the fix."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}. {fix}" if fix else problem)


class UsageError(SpecctlError):
    """A flag or argument is wrong (unknown method, k <= 0, bad JSON in a flag). Exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A speculative config (flags or ``--speculative-config`` JSON) does not validate."""


class ModelError(SpecctlError):
    """A model cannot be resolved or loaded (missing path, unknown catalogue name, bad checkpoint)."""


class DataError(SpecctlError):
    """A data file or workload cannot be read (missing file, malformed line)."""


class FetchError(SpecctlError):
    """Fetching packages from the registry failed, or what arrived does not match its checksum."""
