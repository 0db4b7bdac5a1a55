"""Errors Terra raises itself (not TF op errors), shared by the compiler's channels and the runtime.

Every Python-side wait of the runtime is bounded; when a bound is reached the wait raises
`TerraTimeoutError`, naming the channel (op / slot) it waited on, so a hang becomes a clear error.
"""


class TerraRuntimeError(RuntimeError):
    """Base class of errors raised by the runtime itself (not by TF ops)."""


class TerraTimeoutError(TerraRuntimeError, TimeoutError):
    """A bounded wait on a channel or on the graph runner ran out of time. `what` names what was
    waited on: a string, or a callable that makes one (formatted only when the wait fails)."""

    def __init__(self, what, timeout):
        what = what() if callable(what) else what
        self.what = what
        self.timeout = timeout
        super().__init__(f"timed out after {timeout:.3f} s waiting on {what}")


class ChannelClosedError(TerraRuntimeError):
    """A channel was closed while (or before) Python waited on it."""
