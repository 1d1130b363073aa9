"""The control host side of `fleetd doctor`: the files the service user must read (the fleet CA,
the controller's certificate), the broker taking that certificate, the rendezvous store's port."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import ssl
import stat
from pathlib import Path

from fleetd.config import FleetdConfig
from fleetd.doctor.result import Check
from fleetd.localnet import port_answers
from fleetd.shared.mqtt_options import tls_context
from fleetd.shared.waits import within

SERVICE_USER = "fleetd"  # deploy/sysusers/fleetd.conf; systemd/fleetd.service runs as it


def service_identity(user: str | None) -> tuple[str, int, set[int]]:
    """(name, uid, gids) of the user fleetd.service runs as: ``user``, else fleetd when it exists,
    else whoever runs the doctor."""
    name = user or SERVICE_USER
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        if user is not None:
            raise
        pw = pwd.getpwuid(os.getuid())
    gids = {pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}
    return pw.pw_name, pw.pw_uid, gids


def can_read(path: Path, uid: int, gids: set[int]) -> str | None:
    """None when ``uid`` (with ``gids``) can read ``path``; else why not. Root reads anything."""
    if uid == 0:
        return None if path.exists() else f"{path} does not exist"
    for parent in [*reversed(path.parents)]:
        why = _allowed(parent, uid, gids, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)
        if why:
            return why
    return _allowed(path, uid, gids, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)


def _allowed(path: Path, uid: int, gids: set[int], u: int, g: int, o: int) -> str | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path} does not exist"
    except PermissionError:
        return f"{path} cannot be examined"
    mode = st.st_mode
    ok = (mode & u) if st.st_uid == uid else (mode & g) if st.st_gid in gids else (mode & o)
    if ok:
        return None
    owner = f"{_user(st.st_uid)}:{_group(st.st_gid)} {stat.filemode(mode)}"
    return f"{path} ({owner})"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def files_fleetd_reads(cfg: FleetdConfig) -> list[Path]:
    files = [p for p in (cfg.mqtt.ca_file, cfg.mqtt.cert_file, cfg.mqtt.key_file) if p is not None]
    if cfg.enrol.enabled:
        files += [cfg.enrol.ca_dir / "ca.crt", cfg.enrol.ca_dir / "ca.key", cfg.enrol.identity_certificate]
    return list(dict.fromkeys(files))


def file_checks(cfg: FleetdConfig, user: str | None) -> list[Check]:
    try:
        name, uid, gids = service_identity(user)
    except KeyError:
        return [
            Check.fail("service user", f"no user {user!r} on this host", "systemd-sysusers deploy/sysusers/fleetd.conf")
        ]
    files = files_fleetd_reads(cfg)
    if not files:
        return [Check.skip("certificate files", "plain MQTT and no enrolment: no key or CA to read")]
    unreadable = [why for f in files if (why := can_read(f, uid, gids)) is not None]
    if unreadable:
        fix = f"fleetd ca init --dir {cfg.enrol.ca_dir} --group {name} ... (or chgrp {name} and chmod 0640 these files)"
        return [Check.fail("certificate files", f"{name} cannot read: {'; '.join(unreadable)}", fix, fatal=True)]
    return [Check.ok("certificate files", f"{name} reads {len(files)} file(s): {', '.join(str(f) for f in files)}")]


def identity_check(cfg: FleetdConfig) -> Check:
    """HA, and several jobs' controllers on one broker (a team): each controller needs its own
    MQTT identity. The broker names a session after the certificate's CN
    (use_username_as_clientid), so two controllers with one certificate take each other's session
    over, again and again."""
    if cfg.ha.backend != "dynamodb" and not cfg.team.member:
        return Check.skip("controller identity", "one control host, one controller")
    if cfg.mqtt.cert_file is None:
        return Check.skip("controller identity", "no client certificate (plain MQTT)")
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from fleetd.identity.ca import CONTROLLER_CN

    try:
        cert = x509.load_pem_x509_certificate(cfg.mqtt.cert_file.read_bytes())
    except (OSError, ValueError) as exc:
        return Check.fail("controller identity", f"{cfg.mqtt.cert_file}: {exc}", "fleetd ca init", fatal=True)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    if cn == CONTROLLER_CN and cfg.team.member and cfg.ha.backend != "dynamodb":
        name = cfg.fleet.name
        fix = (
            f"fleetd ca init --dir {cfg.enrol.ca_dir} --controller-host {name} (and every other job's fleet name), "
            f"then [mqtt] cert_file/key_file = {cfg.enrol.ca_dir}/{CONTROLLER_CN}-{name}.crt/.key, and install the new acl"
        )
        return Check.fail(
            "controller identity",
            f"a team's jobs share the broker: with the shared CN={cn} each controller takes the others' session",
            fix,
            fatal=True,
        )
    if cn == CONTROLLER_CN:
        from fleetd.ha.compose import host_id

        host = host_id(cfg)
        fix = (
            f"fleetd ca init --dir {cfg.enrol.ca_dir} --controller-host {host} (and the other hosts' ids), then "
            f"[mqtt] cert_file/key_file = {cfg.enrol.ca_dir}/{CONTROLLER_CN}-{host}.crt/.key, and install the new acl"
        )
        return Check.fail(
            "controller identity",
            f"HA control hosts share the certificate CN={cn}: each takes the other's broker session",
            fix,
            fatal=True,
        )
    return Check.ok("controller identity", f"CN={cn!s}")


async def broker_check(cfg: FleetdConfig) -> Check:
    """A TLS handshake with the controller's certificate, not an MQTT session: under
    use_username_as_clientid a second session with that certificate would take the running
    controller's over."""
    broker = cfg.mqtt
    try:
        ctx: ssl.SSLContext | None = tls_context(broker)
    except (OSError, ssl.SSLError) as exc:
        return Check.fail("broker", f"the controller's TLS files do not load: {exc}", "see certificate files above")
    try:
        _, writer = await within(asyncio.open_connection(broker.host, broker.port, ssl=ctx), 5.0)
    except (OSError, TimeoutError, ssl.SSLError) as exc:
        fix = "start mosquitto (systemctl status mosquitto), check [mqtt] url and that the broker trusts the fleet CA"
        return Check.fail("broker", f"{broker.url}: {exc or type(exc).__name__}", fix)
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError):
        pass
    how = "TLS handshake with the controller's certificate" if ctx is not None else "plain TCP (no TLS)"
    return Check.ok("broker", f"{broker.url}: {how}")


async def rendezvous_check(cfg: FleetdConfig, host: str) -> Check:
    port = cfg.rendezvous.port
    if await port_answers(host, port, 2.0):
        return Check.ok("rendezvous store", f"{host}:{port} answers")
    return Check.fail(
        "rendezvous store", f"nothing listens on {host}:{port}", "systemctl enable --now fleetd-rendezvous"
    )
