"""Errors that are the user's to fix: printed as one clear line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input or environment. The message names the thing and the fix."""

    exit_code = 2


class ConfigError(UserError):
    """A bad job config; every problem found is listed, each with its key path."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = f"invalid config: {self.problems[0]}"
        else:
            message = "invalid config:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


def user_error_types() -> tuple[type[BaseException], ...]:
    """Every exception class, from every package, that means "the user's input is wrong"."""
    from elastic.spec import MeshError

    types: list[type[BaseException]] = [UserError, MeshError]
    try:  # checkpointing lands its own user-facing error class
        from checkpointing.errors import CheckpointError

        types.append(CheckpointError)
    except ImportError:
        pass
    return tuple(types)
