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
