"""AWS failures in fleetd's own terms.

Every adapter call goes through :func:`translate` so the reconcile loop only ever sees four kinds of
failure, each with one handling rule:

- ``CapacityUnavailable``: the pool cannot be had right now; mark it unavailable for a TTL and let
  the next pass try other pools.
- ``Throttled``: AWS asks us to slow down; back off (botocore's adaptive retries already tried).
- ``TransientAwsError``: a 5xx or a network failure; retry on the next pass.
- ``PermanentAwsError``: retrying cannot help (permissions, bad parameters, missing resources);
  stop that action, log one clear line, count it, and do not crash-loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from botocore.exceptions import BotoCoreError, ClientError

# Error codes that mean "this pool has no capacity for us now" (EC2 API error codes, and the
# per-override ErrorCode values of an instant CreateFleet's Errors list).
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "MaxSpotInstanceCountExceeded",
        "SpotMaxPriceTooLow",
        "UnfulfillableCapacity",
        "VcpuLimitExceeded",
        "InsufficientFreeAddressesInSubnet",
    }
)

THROTTLE_CODES = frozenset(
    {"RequestLimitExceeded", "Throttling", "ThrottlingException", "RequestThrottled", "SlowDown"}
)

TRANSIENT_CODES = frozenset({"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable", "RequestTimeout"})


class AwsError(Exception):
    """Base of every translated AWS failure."""

    kind = "aws"

    def __init__(self, operation: str, code: str, message: str):
        self.operation = operation
        self.code = code
        self.message = message
        super().__init__(f"{operation}: {code}: {message}")

    def __reduce__(self) -> tuple[type[AwsError], tuple[str, str, str]]:
        # Picklable with its fields (the EC2 listing process sends its errors back over a pipe).
        return (type(self), (self.operation, self.code, self.message))


class CapacityUnavailable(AwsError):
    kind = "capacity"


class Throttled(AwsError):
    kind = "throttled"


class TransientAwsError(AwsError):
    kind = "transient"


class PermanentAwsError(AwsError):
    kind = "permanent"


def classify_code(code: str, http_status: int | None = None) -> type[AwsError]:
    """The error class for an AWS error code (also used for CreateFleet's per-pool errors)."""
    if code in CAPACITY_CODES or code.startswith("InsufficientInstanceCapacity"):
        return CapacityUnavailable
    if code in THROTTLE_CODES:
        return Throttled
    if code in TRANSIENT_CODES or (http_status is not None and http_status >= 500):
        return TransientAwsError
    return PermanentAwsError


def translate(exc: BaseException, operation: str) -> AwsError:
    """Map a botocore exception to a project error. Anything unknown is permanent: retrying an
    unknown failure in a tight loop is how a controller burns quota and floods logs."""
    if isinstance(exc, AwsError):
        return exc
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code") or "Unknown")
        # EC2 sometimes prefixes server-side codes ("Server.InsufficientInstanceCapacity").
        code = code.removeprefix("Server.").removeprefix("Client.")
        message = str(err.get("Message") or "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return classify_code(code, status)(operation, code, message)
    if isinstance(exc, BotoCoreError):
        # Connection resets, read timeouts, endpoint not reachable: the network, not the request.
        return TransientAwsError(operation, type(exc).__name__, str(exc))
    return PermanentAwsError(operation, type(exc).__name__, str(exc))


@asynccontextmanager
async def aws_call(operation: str) -> AsyncIterator[None]:
    """``async with aws_call("CreateFleet"): await client.create_fleet(...)`` raises only AwsError."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise translate(exc, operation) from exc
