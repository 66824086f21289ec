"""Errors that borrowd reports to a user: each names the key, field or input at fault.

The CLI turns any `BorrowdError` into a one-line message and exit code 2.
"""


class BorrowdError(Exception):
    """Base of every error that is the user's input, not a bug."""


class ConfigError(BorrowdError):
    """A configuration key has a missing, malformed or out-of-range value."""


class InputError(BorrowdError):
    """A command-line argument or input file is malformed or missing."""


class BudgetRecordError(BorrowdError):
    """A budget record in Redis is malformed or of a foreign schema version."""


class FencedError(BorrowdError):
    """A write from an epoch older than the pool's newest: the writer is no longer leader."""

    def __init__(self, pool: str, epoch: int, newest_epoch: int) -> None:
        super().__init__(
            f"budget write to pool {pool!r} refused: epoch {epoch} is older than epoch "
            f"{newest_epoch} (this writer was deposed)"
        )
        self.pool = pool
        self.epoch = epoch
        self.newest_epoch = newest_epoch


class StoreError(Exception):
    """The budget store or the leader election could not be reached or answered badly.

    Transport-neutral: the Redis adapters raise it for any `redis.RedisError`, so the control
    loop handles an unreachable store without knowing which store it is.
    """
