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


# The session's moto runs as a thread of the pytest worker: beside two CPU burners and another
# worker's demo stack it once took over 10 s to answer a reset (burner run 12, after the deploy
# flow's test). A slow reset is the box, not a fault of the test it follows.
RESET_TIMEOUT_S = 60.0


def reset(endpoint: str) -> None:
    req = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(req, timeout=RESET_TIMEOUT_S).read()
