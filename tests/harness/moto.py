"""moto in server mode (its in-process mock does not work with aiobotocore)."""

from __future__ import annotations

import os
import urllib.request

from botocore.config import Config

# Unimplemented moto calls and injected faults must fail fast, not be retried for seconds.
NO_RETRIES = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=30)

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def use_fake_credentials() -> None:
    """Never let a test reach a real account: fake keys, no profile, no IMDS credential lookups."""
    os.environ.update(FAKE_CREDENTIALS)
    os.environ.pop("AWS_PROFILE", None)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def reset(endpoint: str) -> None:
    req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(req, timeout=10).read()
