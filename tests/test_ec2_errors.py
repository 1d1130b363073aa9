"""botocore failures in fleetd's terms: capacity, throttled, transient, permanent."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from fleetd.adapters.aws_errors import (
    CapacityUnavailable,
    PermanentAwsError,
    Throttled,
    TransientAwsError,
    aws_call,
    classify_code,
    translate,
)


def client_error(code: str, status: int = 400, message: str = "m") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "CreateFleet"
    )


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("InsufficientInstanceCapacity", 500, CapacityUnavailable),
        ("Server.InsufficientInstanceCapacity", 500, CapacityUnavailable),
        ("MaxSpotInstanceCountExceeded", 400, CapacityUnavailable),
        ("SpotMaxPriceTooLow", 400, CapacityUnavailable),
        ("UnfulfillableCapacity", 400, CapacityUnavailable),
        ("RequestLimitExceeded", 503, Throttled),
        ("InternalError", 500, TransientAwsError),
        ("SomethingNew", 502, TransientAwsError),
        ("UnauthorizedOperation", 403, PermanentAwsError),
        ("InvalidParameterValue", 400, PermanentAwsError),
        ("InvalidLaunchTemplateId.NotFound", 400, PermanentAwsError),
    ],
)
def test_client_error_codes(code: str, status: int, kind: type) -> None:
    err = translate(client_error(code, status, "why"), "CreateFleet")
    assert type(err) is kind
    assert (err.operation, err.code.removeprefix("Server."), err.message) == (
        "CreateFleet",
        code.removeprefix("Server."),
        "why",
    )


def test_network_failures_are_transient_and_unknown_exceptions_permanent() -> None:
    assert isinstance(translate(EndpointConnectionError(endpoint_url="http://x"), "X"), TransientAwsError)
    assert isinstance(translate(ReadTimeoutError(endpoint_url="http://x"), "X"), TransientAwsError)
    assert isinstance(translate(RuntimeError("bug"), "X"), PermanentAwsError)


def test_per_override_codes_classify_like_call_codes() -> None:
    assert classify_code("InsufficientInstanceCapacity").kind == "capacity"
    assert classify_code("RequestLimitExceeded").kind == "throttled"
    assert classify_code("UnauthorizedOperation").kind == "permanent"


async def test_aws_call_raises_only_project_errors() -> None:
    with pytest.raises(Throttled) as info:
        async with aws_call("DescribeInstances"):
            raise client_error("RequestLimitExceeded", 503)
    assert isinstance(info.value.__cause__, ClientError)
