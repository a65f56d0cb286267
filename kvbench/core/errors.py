"""Errors meant for users: the CLI prints them as one sentence, no traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, unreachable endpoint).

    The message is one sentence naming the file, field or endpoint and what to do.
    """

    exit_code = 2


class DataError(UserError):
    """Results that cannot be read or compared (missing baseline, other schema version)."""

    exit_code = 3
