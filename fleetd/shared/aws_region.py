"""Where the AWS region comes from, in the order the AWS tools use: the config (``[aws] region``
or FLEETD_AWS__REGION), then AWS_REGION / AWS_DEFAULT_REGION, then the profile's region in
~/.aws/config, then, on EC2, the instance's own region (IMDS). A local endpoint (moto) with
none of them runs in us-east-1. Anything else is an error at start, never a silent default: a
fleet in the wrong region buys nothing, or buys where its checkpoints are not.

The source is kept beside the region (``AwsConfig.region_source``) and `fleetd doctor` shows it.
The config and the environment are read here, with the settings (pure); the profile and the
instance take I/O and are asked at start (fleetd/adapters/region.py; the agent uses its zone).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

LOCAL_DEFAULT = "us-east-1"
_ZONE = re.compile(r"^([a-z]{2}(?:-gov)?-[a-z]+-\d+)")


def region_of_zone(zone: str) -> str:
    """us-east-1a -> us-east-1; a Local Zone (us-west-2-lax-1a) -> its parent region."""
    m = _ZONE.match(zone)
    if m is None:
        raise ValueError(f"not an availability zone name: {zone!r}")
    return m.group(1)


def region_from_environment(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(region, source) from AWS_REGION / AWS_DEFAULT_REGION; None when neither is set."""
    env = os.environ if environ is None else environ
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if env.get(var):
            return env[var], f"environment ({var})"
    return None
