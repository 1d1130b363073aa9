"""AWS's answers as the fault proxy (faults.py) writes them: EC2's query-protocol error XML and
CreateFleet's per-pool ``errorSet``, the Price List API's JSON errors, and the CreateFleet request
rewriting that removes failing pools from what moto sees. Shapes from AWS's API references."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode
from xml.sax.saxutils import escape

from aiohttp import web

from fleetd.policy.model import PoolId

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"

# HTTP status AWS uses for each error code it can answer with (call-level).
HTTP_STATUS = {
    "RequestLimitExceeded": 503,
    "InsufficientInstanceCapacity": 500,
    "InternalError": 500,
    "Unavailable": 503,
    "UnauthorizedOperation": 403,
    "AuthFailure": 401,
}

# The Price List API (JSON protocol) answers errors with these statuses.
JSON_HTTP_STATUS = {
    "ThrottlingException": 400,
    "AccessDeniedException": 400,
    "InvalidParameterException": 400,
    "InternalErrorException": 500,
    "ServiceUnavailableException": 503,
}

MESSAGES = {
    "RequestLimitExceeded": "Request limit exceeded.",
    "InsufficientInstanceCapacity": (
        "We currently do not have sufficient {itype} capacity in the Availability Zone you requested"
        " ({zone}). Our system will be working on provisioning additional capacity."
    ),
    "MaxSpotInstanceCountExceeded": "Max spot instance count exceeded",
    "SpotMaxPriceTooLow": "Your Spot request price of {price} is lower than the minimum required Spot request fulfillment price of 0.5.",
    "UnfulfillableCapacity": "Unable to fulfill capacity due to your request configuration. Please adjust your request and try again.",
    "UnauthorizedOperation": "You are not authorized to perform this operation. Encoded authorization failure message: fake-{request_id}",
    "InternalError": "An internal error has occurred",
}


def json_response(status: int, body: dict[str, Any]) -> web.Response:
    headers = {"x-amzn-RequestId": str(uuid.uuid4())}
    if status >= 400:
        headers["x-amzn-ErrorType"] = str(body.get("__type", ""))
    return web.Response(
        text=json.dumps(body), status=status, headers=headers, content_type="application/x-amz-json-1.1"
    )


def fleet_overrides(params: Mapping[str, str]) -> list[dict[str, str]]:
    """LaunchTemplateConfigs.1.Overrides.N.* of a query-protocol CreateFleet request."""
    prefix = "LaunchTemplateConfigs.1.Overrides."
    found: dict[int, dict[str, str]] = {}
    for key, value in params.items():
        if key.startswith(prefix):
            n, _, field_name = key[len(prefix) :].partition(".")
            found.setdefault(int(n), {})[field_name] = value
    return [found[n] for n in sorted(found)]


def with_overrides(params: Mapping[str, str], keep: list[dict[str, str]]) -> str:
    prefix = "LaunchTemplateConfigs.1.Overrides."
    out = {k: v for k, v in params.items() if not k.startswith(prefix)}
    for n, override in enumerate(keep, start=1):
        for field_name, value in override.items():
            out[f"{prefix}{n}.{field_name}"] = value
    return urlencode(out)


def message(code: str, pool: PoolId | None, override: Mapping[str, str] | None = None) -> str:
    template = MESSAGES.get(code, code)
    return template.format(
        itype=pool.instance_type if pool else "the requested",
        zone=pool.zone if pool else "the requested zone",
        price=(override or {}).get("MaxPrice", "0.001"),
        request_id=uuid.uuid4().hex[:12],
    )


def error_response(code: str, pool: PoolId | None) -> web.Response:
    request_id = str(uuid.uuid4())
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{escape(code)}</Code>"
        f"<Message>{escape(message(code, pool))}</Message></Error></Errors>"
        f"<RequestID>{request_id}</RequestID></Response>"
    )
    return web.Response(text=xml, status=HTTP_STATUS.get(code, 400), content_type="text/xml")


def error_item(params: Mapping[str, str], override: Mapping[str, str], code: str, pool: PoolId) -> str:
    lt_id = params.get("LaunchTemplateConfigs.1.LaunchTemplateSpecification.LaunchTemplateId", "")
    version = params.get("LaunchTemplateConfigs.1.LaunchTemplateSpecification.Version", "1")
    lifecycle = "spot" if params.get("TargetCapacitySpecification.DefaultTargetCapacityType") == "spot" else "on-demand"
    ov = "".join(
        f"<{k[0].lower() + k[1:]}>{escape(v)}</{k[0].lower() + k[1:]}>"
        for k, v in override.items()
        if k in ("InstanceType", "SubnetId", "AvailabilityZone", "MaxPrice")
    )
    return (
        "<item><launchTemplateAndOverrides><launchTemplateSpecification>"
        f"<launchTemplateId>{escape(lt_id)}</launchTemplateId><version>{escape(version)}</version>"
        f"</launchTemplateSpecification><overrides>{ov}</overrides></launchTemplateAndOverrides>"
        f"<lifecycle>{lifecycle}</lifecycle><errorCode>{escape(code)}</errorCode>"
        f"<errorMessage>{escape(message(code, pool, override))}</errorMessage></item>"
    )


def create_fleet_response(
    params: Mapping[str, str], errors: list[tuple[dict[str, str], str, PoolId]], upstream_xml: str | None
) -> web.Response:
    items = "".join(error_item(params, o, code, pool) for o, code, pool in errors)
    error_set = f"<errorSet>{items}</errorSet>"
    if upstream_xml is None:
        # Every pool failed: AWS still answers 200 with a fleet id and only the errors.
        xml = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<CreateFleetResponse xmlns="{EC2_NS}">'
            f"<requestId>{uuid.uuid4()}</requestId><fleetId>fleet-{uuid.uuid4()}</fleetId>"
            f"{error_set}<fleetInstanceSet/></CreateFleetResponse>"
        )
    else:
        xml = upstream_xml.replace("</CreateFleetResponse>", f"{error_set}</CreateFleetResponse>", 1)
    return web.Response(text=xml, status=200, content_type="text/xml")
