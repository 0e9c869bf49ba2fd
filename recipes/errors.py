"""The base of every error a user can cause or fix: `UserError`. Its message is one line (or one
line per problem) that says what to do; the CLI prints it without a traceback and exits with the
kind's `exit_code`, and a flow run that raises it fails with that message as its state's (and,
when `permanent`, at once: no retry of something a retry cannot fix).

It lives in the lowest layer, importing nothing of the project, so that every layer's errors are
built on the one base: the recipes' own (`RecipeError`, recipes/base.py) as much as the kinds
with their exit codes in tasks/errors.py.
"""

from __future__ import annotations


class UserError(Exception):
    """An error whose message is the whole story: no traceback. `permanent`: running the same
    thing again without a change gives the same error, so a flow run is not retried."""

    exit_code: int = 2
    permanent: bool = True

    def lines(self) -> list[str]:
        """The message, one line per problem (a pre-flight may find several)."""
        return [line for line in str(self).splitlines() if line.strip()] or [type(self).__name__]
