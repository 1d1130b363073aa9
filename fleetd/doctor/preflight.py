"""What `fleetd run` checks before it starts buying: the doctor's checks that no amount of
retrying would fix, and that cost one call or none. A failure stops the start with the reason
and its fix (the full list: `fleetd doctor`)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from fleetd.config import FleetdConfig
from fleetd.doctor.host import file_checks, identity_check
from fleetd.doctor.result import Check, fatal
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


async def preflight(cfg: FleetdConfig, session: Any, service_user: str | None = None) -> list[Check]:
    """The fatal failures (empty: go)."""
    checks = [*file_checks(cfg, service_user), identity_check(cfg)]
    kw: dict[str, Any] = {"region_name": cfg.aws.region}
    if cfg.aws.endpoint_url:
        kw["endpoint_url"] = cfg.aws.endpoint_url
    async with session.create_client("sts", **kw) as sts:
        try:
            await sts.get_caller_identity()
        except (NoCredentialsError, PartialCredentialsError, ClientError) as exc:
            # A definite answer: no credentials here, or AWS refused them.
            fix = "run on the control host with its instance role, or set [aws] profile / AWS_PROFILE"
            checks.append(Check.fail("credentials", f"no usable AWS credentials: {exc}", fix, fatal=True))
        except BotoCoreError as exc:
            # AWS unreachable for now (a network blip at boot): not a reason to stay down, which
            # under systemd's start limit could leave the controller failed for good. The loop
            # rides through it like any outage.
            log.warning("preflight_aws_unreachable", error=str(exc))
    return fatal(checks)
