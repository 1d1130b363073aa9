"""The arguments every AWS client of the controller is made with: its region, the endpoint (moto,
LocalStack) when one is configured, and production retries. One place, so that the daemon, the
state backup, the team's pricing and a region move all talk to AWS the same way."""

from __future__ import annotations

from typing import Any

from botocore.config import Config

# Production: botocore's adaptive mode retries throttling with a client-side rate limiter, so the
# loop's own backoff only sees what is left after that.
PRODUCTION_RETRIES = Config(retries={"mode": "adaptive", "total_max_attempts": 6}, connect_timeout=10, read_timeout=60)


def client_kwargs(cfg: Any, region: str | None = None) -> dict[str, Any]:
    """For ``cfg``'s region (or ``region``)."""
    kwargs: dict[str, Any] = {"region_name": region or cfg.aws.region, "config": PRODUCTION_RETRIES}
    if cfg.aws.endpoint_url:
        kwargs["endpoint_url"] = cfg.aws.endpoint_url
    return kwargs


def ec2_client_kwargs(cfg: Any) -> dict[str, Any]:
    return client_kwargs(cfg)


def s3_client_kwargs(cfg: Any) -> dict[str, Any]:
    return client_kwargs(cfg)


def pricing_client_kwargs(cfg: Any) -> dict[str, Any]:
    """The Price List API lives in a few regions only (us-east-1 answers for every region)."""
    return client_kwargs(cfg, cfg.capacity.price_list_region)


def open_s3(cfg: Any) -> Any:
    """An async context manager yielding an aiobotocore S3 client for ``cfg``."""
    from aiobotocore.session import get_session

    session = get_session()
    if cfg.aws.profile:
        session.set_config_variable("profile", cfg.aws.profile)
    return session.create_client("s3", **s3_client_kwargs(cfg))
