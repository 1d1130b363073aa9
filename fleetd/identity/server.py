"""The enrolment endpoint inside ``fleetd run``: POST /v1/enrol (fleetd/protocol/enrol.py).

Bad input is answered 400 and logged, a refusal 403 with its reason, an EC2 hiccup 503 (the agent
retries); nothing a client sends can stop the daemon.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from fleetd.identity.service import Enrolment, LookupUnavailable, Refused
from fleetd.protocol.enrol import ENROL_PATH, MAX_REQUEST_BYTES, EnrolRefusal, EnrolRequest, parse_model
from fleetd.protocol.errors import ProtocolError
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


def _refusal(status: int, reason: str) -> web.Response:
    return web.Response(
        status=status, body=EnrolRefusal(reason=reason[:500]).to_json(), content_type="application/json"
    )


def app(enrolment: Enrolment) -> web.Application:
    async def enrol(request: web.Request) -> web.Response:
        peer = request.remote or "?"
        try:
            body = await request.content.read(MAX_REQUEST_BYTES + 1)
            if len(body) > MAX_REQUEST_BYTES:
                raise ProtocolError(f"request larger than {MAX_REQUEST_BYTES} bytes")
            req = parse_model(EnrolRequest, body)
        except ProtocolError as exc:
            log.warning("enrol_request_rejected", peer=peer, reason=str(exc)[:300])
            return _refusal(400, str(exc))
        try:
            resp = await enrolment.enrol(req)  # type: ignore[arg-type]
        except Refused as exc:
            return _refusal(403, str(exc))
        except LookupUnavailable as exc:
            log.warning("enrol_lookup_failed", peer=peer, error=str(exc)[:300])
            return _refusal(503, "EC2 could not be asked; retry")
        return web.Response(body=resp.to_json(), content_type="application/json")

    application = web.Application(client_max_size=MAX_REQUEST_BYTES)
    application.router.add_post(ENROL_PATH, enrol)
    return application


class EnrolmentServer:
    def __init__(self, enrolment: Enrolment, host: str, port: int) -> None:
        self.enrolment = enrolment
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        self._runner = web.AppRunner(app(self.enrolment), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.bound_port = self._runner.addresses[0][1]
        log.info("enrolment_listening", host=self.host, port=self.bound_port)
        return self.bound_port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def serve(self, stopping: asyncio.Event) -> None:
        await self.start()
        try:
            await stopping.wait()
        finally:
            await self.stop()


def enrolment_component(cfg: Any) -> Any:
    """``fleetd run``'s component: the embedded CA, AWS's identity certificate, and EC2 through
    the production adapter (its own client, so enrolment never waits on a reconcile pass)."""

    async def enrolment(ctx: Any) -> None:
        from aiobotocore.session import get_session

        from fleetd.adapters.ec2 import AioEc2
        from fleetd.identity.bindings import BindingStore
        from fleetd.identity.ca import CaFiles, LocalCa
        from fleetd.identity.iid import load_signer_certificate
        from fleetd.identity.rules import EnrolSettings
        from fleetd.reconcile.build import ec2_client_kwargs

        e = cfg.enrol
        try:
            ca = await asyncio.to_thread(LocalCa.load, CaFiles(e.ca_dir))
            signer = await asyncio.to_thread(load_signer_certificate, e.identity_certificate)
        except (OSError, ValueError) as exc:
            # Budget and interruption handling must not stop for this: the daemon runs on, and
            # says loudly why no node can get a certificate.
            log.error(
                "enrolment_unavailable",
                error=str(exc),
                ca_dir=str(e.ca_dir),
                identity_certificate=str(e.identity_certificate),
                why="nodes cannot get MQTT certificates until this is fixed (fleetd ca init)",
            )
            await ctx.stopping.wait()
            return
        bindings = await asyncio.to_thread(BindingStore, cfg.fleet.state_dir / "enrolments.json")
        settings = EnrolSettings(
            region=cfg.aws.region, cert_lifetime_s=e.cert_lifetime_s, max_document_age_s=e.max_document_age_s
        )
        session = get_session()
        if cfg.aws.profile:
            session.set_config_variable("profile", cfg.aws.profile)
        async with session.create_client("ec2", **ec2_client_kwargs(cfg)) as client:
            ec2 = AioEc2(client, fleet=cfg.fleet.name, job=cfg.job.name)
            service = Enrolment(ca, signer, ec2.fleet_instance_state, settings, bindings)
            await EnrolmentServer(service, e.host, e.port).serve(ctx.stopping)

    return enrolment
