"""kvtier's exceptions: one class per status code, under one base per retry advice.

Every error raised by kvtier is a :class:`KvtierError` carrying ``code`` (the C++
``StatusCode`` name, e.g. ``"InvalidArgument"``) and ``message`` (which names the bad
value). Catch by what you will do next:

- :class:`DoNotRetryError`: fix the input or the configuration (``InvalidArgumentError`` is
  also a ``ValueError``, ``OutOfRangeError`` an ``IndexError``, ``NotFoundError`` a
  ``LookupError``, ``NotSupportedError`` a ``NotImplementedError``).
- :class:`RetryError`: retry the same call (``TimedOutError`` is also a ``TimeoutError``).
- :class:`BackoffRetryError`: retry after freeing resources or waiting.
- :class:`RecomputeError`: the data is gone; treat the blocks as a miss and recompute.
- :class:`FatalError`: the device or this instance is unusable.
"""

from __future__ import annotations

__all__ = [
    "KvtierError", "DoNotRetryError", "RetryError", "BackoffRetryError", "RecomputeError", "FatalError",
    "InvalidArgumentError", "OutOfRangeError", "FailedPreconditionError", "NotFoundError", "AlreadyExistsError",
    "ResourceExhaustedError", "UnavailableError", "AbortedError", "CancelledError", "TimedOutError",
    "DataLossError", "NotSupportedError", "DeviceLostError", "InternalError", "CLASS_BY_CODE",
]


class KvtierError(RuntimeError):
    """Base of every kvtier error: ``code`` is the status code name, ``message`` the text."""

    advice = "none"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or type(self).__name__.removesuffix("Error")

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class DoNotRetryError(KvtierError):
    advice = "do_not_retry"


class RetryError(KvtierError):
    advice = "retry"


class BackoffRetryError(KvtierError):
    advice = "backoff_retry"


class RecomputeError(KvtierError):
    advice = "recompute"


class FatalError(KvtierError):
    advice = "fatal"


class InvalidArgumentError(DoNotRetryError, ValueError):
    pass


class OutOfRangeError(DoNotRetryError, IndexError):
    pass


class FailedPreconditionError(DoNotRetryError):
    pass


class NotFoundError(DoNotRetryError, LookupError):
    pass


class AlreadyExistsError(DoNotRetryError):
    pass


class NotSupportedError(DoNotRetryError, NotImplementedError):
    pass


class ResourceExhaustedError(BackoffRetryError):
    pass


class UnavailableError(RetryError):
    pass


class TimedOutError(RetryError, TimeoutError):
    pass


class AbortedError(RetryError):
    pass


class CancelledError(DoNotRetryError):
    pass


class DataLossError(RecomputeError):
    pass


class DeviceLostError(FatalError):
    pass


class InternalError(FatalError):
    pass


CLASS_BY_CODE = {
    "InvalidArgument": InvalidArgumentError,
    "OutOfRange": OutOfRangeError,
    "FailedPrecondition": FailedPreconditionError,
    "NotFound": NotFoundError,
    "AlreadyExists": AlreadyExistsError,
    "ResourceExhausted": ResourceExhaustedError,
    "Unavailable": UnavailableError,
    "Aborted": AbortedError,
    "Cancelled": CancelledError,
    "TimedOut": TimedOutError,
    "DataLoss": DataLossError,
    "NotSupported": NotSupportedError,
    "DeviceLost": DeviceLostError,
    "Internal": InternalError,
}
