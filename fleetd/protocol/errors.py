"""The one error type for input that crosses a process boundary and fails validation."""


class ProtocolError(ValueError):
    """A message, topic, manifest or config value from another process is not acceptable.

    Handlers catch this, log it once with the offending source, and drop the input: bad input never
    crashes a daemon.
    """
