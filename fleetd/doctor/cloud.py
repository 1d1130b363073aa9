"""The account side of `fleetd doctor`: credentials, each EC2 action fleetd needs (DryRun where
EC2 offers it), the spot vCPU quota of every GPU family the config may buy, the bucket, subnets,
security groups, AMI, launch template and event queue. Each check is one call and one line."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from fleetd.adapters.catalog import load_catalog
from fleetd.config import FleetdConfig
from fleetd.doctor.quotas import needs
from fleetd.doctor.result import Check
from fleetd.pool_listing import types_for

POLICY = "attach deploy/iam/controller-policy.json to the control host's role (deploy/README.md)"
DENIED = ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "UnauthorizedException")
PROBE_ID = "i-00000000000000000"


def _code(exc: Exception) -> str:
    return str(exc.response.get("Error", {}).get("Code", "")) if isinstance(exc, ClientError) else type(exc).__name__


async def _dry_run(name: str, call: Callable[[], Awaitable[Any]], action: str, *, fatal: bool) -> Check:
    """EC2's DryRun answers DryRunOperation when the call would be allowed."""
    try:
        await call()
    except ClientError as exc:
        code = _code(exc)
        if code == "DryRunOperation":
            return Check.ok(name, f"{action} allowed (dry run)")
        if code in DENIED:
            return Check.fail(name, f"{action} denied: {code}", POLICY, fatal=fatal)
        return Check.fail(
            name, f"{action}: {code}: {exc}", "see the error; fleetd makes this call to launch", fatal=fatal
        )
    return Check.warn(name, f"{action} ran for real instead of as a dry run")


async def account_checks(cfg: FleetdConfig, session: Any) -> list[Check]:
    out: list[Check] = [Check.ok("region", f"{cfg.aws.region} (from {cfg.aws.region_source})")]
    kw: dict[str, Any] = {"region_name": cfg.aws.region}
    if cfg.aws.endpoint_url:
        kw["endpoint_url"] = cfg.aws.endpoint_url
    async with session.create_client("sts", **kw) as sts:
        try:
            who = await sts.get_caller_identity()
        except (ClientError, BotoCoreError) as exc:
            out.append(
                Check.fail(
                    "credentials",
                    f"no usable AWS credentials: {exc}",
                    "run on the control host with its instance role, or set [aws] profile / AWS_PROFILE",
                    fatal=True,
                )
            )
            return out
    out.append(Check.ok("credentials", f"account {who['Account']}, {who['Arn']}"))
    async with session.create_client("ec2", **kw) as ec2:
        out += await _ec2_checks(cfg, ec2)
    async with session.create_client("service-quotas", **kw) as sq:
        out += await _quota_checks(cfg, sq)
    async with session.create_client("s3", **kw) as s3:
        out.append(await _bucket_check(cfg, s3))
    out += await _other_region_checks(cfg, session)
    if cfg.events.sqs_queue_url:
        async with session.create_client("sqs", **kw) as sqs:
            out.append(await _queue_check(cfg, sqs))
    else:
        out.append(Check.skip("event queue", "events.sqs_queue_url unset: notices come from the agents only"))
    return out


async def _other_region_checks(cfg: FleetdConfig, session: Any) -> list[Check]:
    """Each [[team.regions]] entry's bucket and AMI, as a move there would need them: a move to a
    region whose bucket cannot take the copy leaves the job stopped until it can."""
    from fleetd.adapters.aws_clients import client_kwargs
    from fleetd.team.region_file import allowed_regions, in_region

    out: list[Check] = []
    for region in allowed_regions(cfg)[1:]:
        there = in_region(cfg, region)
        async with session.create_client("s3", **client_kwargs(there)) as s3:
            out.append(_in(region, await _bucket_check(there, s3)))
        async with session.create_client("ec2", **client_kwargs(there)) as ec2:
            out.append(_in(region, await _ami_check(there, ec2)))
    return out


def _in(region: str, check: Check) -> Check:
    """A check of another region's resource: named for it, and never fatal to this region's start."""
    return replace(check, name=f"{check.name} ({region})", fatal=False)


async def _ec2_checks(cfg: FleetdConfig, ec2: Any) -> list[Check]:
    cap = cfg.capacity
    out: list[Check] = []
    fleet_filter = [{"Name": "tag:fleetd:fleet", "Values": [cfg.fleet.name]}]
    try:
        found = await ec2.describe_instances(Filters=fleet_filter)
        mine = [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]]
        out.append(Check.ok("ec2:Describe*", f"{len(mine)} instance(s) of fleet {cfg.fleet.name} now"))
    except ClientError as exc:
        out.append(Check.fail("ec2:Describe*", f"denied: {_code(exc)}", POLICY, fatal=True))
        return out
    types = types_for(load_catalog(), cfg.aws.region, cap.instance_types, cap.gpu)
    tags = [{"ResourceType": "instance", "Tags": [{"Key": "fleetd:fleet", "Value": cfg.fleet.name}]}]
    if types and (cap.ami_id or cap.launch_template):
        source = (
            {"ImageId": cap.ami_id} if cap.ami_id else {"LaunchTemplate": {"LaunchTemplateName": cap.launch_template}}
        )
        launch = dict(source, InstanceType=types[0], MinCount=1, MaxCount=1, TagSpecifications=tags, DryRun=True)
        out.append(await _dry_run("ec2:RunInstances", lambda: ec2.run_instances(**launch), "launch", fatal=True))
    else:
        out.append(Check.skip("ec2:RunInstances", "no instance type or image in the config to try a launch with"))
    if mine:
        stop = {"InstanceIds": mine[:1], "DryRun": True}
        out.append(
            await _dry_run("ec2:TerminateInstances", lambda: ec2.terminate_instances(**stop), "terminate", fatal=False)
        )
    else:
        out.append(Check.skip("ec2:TerminateInstances", "no instance of this fleet to try it on (it is tag-scoped)"))
    out.append(await _ids_check("subnets", cap.subnet_ids, lambda ids: ec2.describe_subnets(SubnetIds=ids)))
    out.append(
        await _ids_check(
            "security groups", cap.security_group_ids, lambda ids: ec2.describe_security_groups(GroupIds=ids)
        )
    )
    out.append(await _ami_check(cfg, ec2))
    out.append(await _template_check(cfg, ec2))
    return out


async def _ids_check(name: str, ids: tuple[str, ...], describe: Callable[[list[str]], Awaitable[Any]]) -> Check:
    if not ids:
        return Check.skip(name, "none configured: the default VPC's")
    try:
        await describe(list(ids))
    except ClientError as exc:
        return Check.fail(
            name,
            f"{', '.join(ids)}: {_code(exc)}",
            f"fix capacity.{name.replace(' ', '_')[:-1]}_ids in fleetd.toml",
            fatal=True,
        )
    return Check.ok(name, ", ".join(ids))


async def _ami_check(cfg: FleetdConfig, ec2: Any) -> Check:
    ami = cfg.capacity.ami_id
    if not ami:
        return Check.skip("ami", "capacity.ami_id unset: the named launch template's image is used")
    try:
        images = (await ec2.describe_images(ImageIds=[ami]))["Images"]
    except ClientError as exc:
        images, err = [], _code(exc)
    else:
        err = "not found"
    if not images:
        return Check.fail(
            "ami", f"{ami}: {err}", "build the node image (deploy/packer) and set capacity.ami_id", fatal=True
        )
    tags = {t["Key"]: t["Value"] for t in images[0].get("Tags", [])}
    version = tags.get("fleetd:agent-version", "unknown (no fleetd:agent-version tag)")
    return Check.ok("ami", f"{ami} {images[0].get('Name', '')}, agent version {version}")


async def _template_check(cfg: FleetdConfig, ec2: Any) -> Check:
    from fleetd.adapters.launch_template import default_template_name

    named = cfg.capacity.launch_template
    name = named or default_template_name(cfg)
    try:
        found = (await ec2.describe_launch_templates(LaunchTemplateNames=[name]))["LaunchTemplates"]
    except ClientError as exc:
        if "NotFound" not in _code(exc):
            return Check.fail("launch template", f"{name}: {_code(exc)}", POLICY)
        found = []
    if found:
        t = found[0]
        latest, default = t.get("LatestVersionNumber"), t.get("DefaultVersionNumber")
        how = "fleetd launches its newest version" if not named else f"launches use $Default (version {default})"
        return Check.ok("launch template", f"{name} ({t['LaunchTemplateId']}), version {latest}: {how}")
    if named:
        return Check.fail(
            "launch template", f"{name!r} does not exist", "create it, or unset capacity.launch_template", fatal=True
        )
    return Check.ok("launch template", f"{name} will be created at the first start")


async def _quota_checks(cfg: FleetdConfig, sq: Any) -> list[Check]:
    catalog = load_catalog()
    types = types_for(catalog, cfg.aws.region, cfg.capacity.instance_types, cfg.capacity.gpu)
    vcpus = {t: spec.vcpu for t in types if (spec := catalog.spec(t)) is not None}
    wanted, unknown = needs(types, vcpus, cfg.fleet.max_nodes)
    out: list[Check] = []
    for need in wanted:
        name = f"spot quota {need.code}"
        try:
            answer = await sq.get_service_quota(ServiceCode="ec2", QuotaCode=need.code)
        except ClientError as exc:
            out.append(Check.warn(name, f"{need.name}: cannot read it ({_code(exc)})", POLICY))
            continue
        value = float(answer["Quota"]["Value"])
        increase = (
            f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {need.code} "
            f"--desired-value {need.vcpus} --region {cfg.aws.region}"
        )
        if value <= 0:
            out.append(Check.fail(name, f"{need.name} is 0 vCPUs: no spot {'/'.join(need.types)} can start", increase))
        elif value < need.vcpus:
            out.append(Check.warn(name, f"{need.name}: {value:g} vCPUs, the fleet may need {need.vcpus}", increase))
        else:
            out.append(Check.ok(name, f"{need.name}: {value:g} vCPUs (the fleet needs up to {need.vcpus})"))
    if unknown:
        out.append(Check.warn("spot quota", f"no known quota code for {', '.join(unknown)}"))
    return out


async def _bucket_check(cfg: FleetdConfig, s3: Any) -> Check:
    bucket = cfg.checkpoints.bucket
    # One write where the controller writes anyway (its state backup): an answer of NoSuchBucket
    # or AccessDenied says all there is (HeadBucket would need s3:ListBucket on the whole bucket).
    from fleetd.state_backup import backup_key

    probe = backup_key(cfg).rsplit("/", 1)[0] + "/doctor-probe"
    try:
        await s3.put_object(Bucket=bucket, Key=probe, Body=b"fleetd doctor")
    except ClientError as exc:
        code = _code(exc)
        if code in ("404", "NoSuchBucket", "NotFound"):
            fix = f"create it in {cfg.aws.region}: aws s3 mb s3://{bucket} --region {cfg.aws.region}"
            return Check.fail("bucket", f"s3://{bucket} does not exist", fix, fatal=True)
        return Check.fail("bucket", f"s3://{bucket}: {code}", POLICY, fatal=True)
    return Check.ok("bucket", f"s3://{bucket} reachable, the controller's state prefix writable")


async def _queue_check(cfg: FleetdConfig, sqs: Any) -> Check:
    url = cfg.events.sqs_queue_url
    try:
        await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    except ClientError as exc:
        fix = "deploy deploy/cloudformation/events.yaml and set events.sqs_queue_url to its QueueUrl output"
        return Check.fail("event queue", f"{url}: {_code(exc)}", fix)
    return Check.ok("event queue", url or "")
