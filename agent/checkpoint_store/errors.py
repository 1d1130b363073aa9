"""The checkpoint store's own error types; adapters translate botocore/aiohttp errors into these."""


class StoreError(Exception):
    """An S3 call failed in a way the caller may report or retry (the reason is in the message)."""


class StoreUnavailable(StoreError):
    """The endpoint could not be reached or timed out (network, DNS, throttling after retries)."""


class ObjectNotFound(StoreError):
    """The key (or multipart upload) does not exist."""


class PreconditionFailed(StoreError):
    """A conditional write lost: If-Match / If-None-Match did not hold (HTTP 412 or 409)."""


class CheckpointCorrupt(StoreError):
    """A file of a manifest-complete checkpoint is missing or does not match its size/checksum."""


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report from a TaskGroup failure: the first StoreError among the leaves, else
    the first leaf (so callers catch StoreError, not an ExceptionGroup)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(group)
    return next((e for e in leaves if isinstance(e, StoreError)), leaves[0])
