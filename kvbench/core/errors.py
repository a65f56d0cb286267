"""Errors meant for users: the CLI prints them as one sentence, no traceback.

The exit codes of ``kvbench`` commands: 0 done; 1 the gate failed; 2 a user error (bad config,
flag or input; the gate's inconclusive with ``--strict``); 3 a data error (results that cannot
be read or compared; the gate's usage errors too); 4 ``kvbench run`` finished, run.json
written, but a job ended incomplete (its Locust child was killed, a worker was lost: the reason
is the last line it prints); 5 a write of the run's results failed (the disk is full): the load
stopped at the first failed write, every child stopped, what was written kept for ``kvbench
recover``; 128 + N stopped by signal N.
"""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file, unreachable endpoint).

    The message is one sentence naming the file, field or endpoint and what to do.
    """

    exit_code = 2


class DataError(UserError):
    """Results that cannot be read or compared (missing baseline, other schema version)."""

    exit_code = 3


# ``kvbench run``: the run finished and run.json is written, but a job's load was cut short
INCOMPLETE_EXIT = 4


# a write of a run's results failed (the disk is full): ``DiskFull``
DISK_FULL_EXIT = 5


class DiskFull(UserError):
    """A write of a run's results failed (no space left, or another write error): one sentence
    naming the run's folder; the load stops at the first failed write."""

    exit_code = DISK_FULL_EXIT
