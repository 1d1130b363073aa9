"""The rest of the region lookup, at start (fleetd/shared/aws_region.py has the order): the
profile's region in ~/.aws/config, then the EC2 instance's own (IMDSv2)."""

from __future__ import annotations

from fleetd.shared.settings import AwsConfig

IMDS_URL = "http://169.254.169.254"


def profile_region(profile: str | None) -> str | None:
    try:
        import botocore.session

        session = botocore.session.Session(profile=profile)
        found = session.get_scoped_config().get("region")
    except Exception:  # noqa: BLE001 - a broken ~/.aws/config: the doctor's credentials check says more
        return None
    return str(found) if found else None


async def instance_region(url: str = IMDS_URL, timeout_s: float = 1.0) -> str | None:
    """The region of the EC2 instance this runs on (IMDSv2), or None off EC2."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.put(f"{url}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}) as r:
                if r.status != 200:
                    return None
                token = await r.text()
            async with http.get(
                f"{url}/latest/meta-data/placement/region", headers={"X-aws-ec2-metadata-token": token}
            ) as r:
                text = (await r.text()).strip()
                return text or None if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def resolve_region(aws: AwsConfig, imds_url: str = IMDS_URL) -> AwsConfig | None:
    """``aws`` with its region found (unchanged when it has one); None when nothing names one."""
    if aws.region:
        return aws
    found = profile_region(aws.profile)
    if found:
        return aws.with_region(found, f"profile ({aws.profile or 'default'})")
    found = await instance_region(imds_url)
    return aws.with_region(found, "instance (IMDS)") if found else None
