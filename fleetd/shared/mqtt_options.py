"""How both daemons connect to the broker: aiomqtt.Client keyword arguments from MqttConfig.

TLS uses the configured CA (or the system store) and, when given, a client certificate; a
username/password is sent only when configured. Kept here because the agent and the controller
must agree on it and the agent may import only fleetd.protocol.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiomqtt

from fleetd.shared.settings import MqttConfig
from fleetd.shared.waits import within

T = TypeVar("T")


def tls_context(cfg: MqttConfig) -> ssl.SSLContext | None:
    if not cfg.tls:
        return None
    ctx = ssl.create_default_context(cafile=str(cfg.ca_file) if cfg.ca_file else None)
    if cfg.cert_file is not None and cfg.key_file is not None:
        ctx.load_cert_chain(str(cfg.cert_file), str(cfg.key_file))
    return ctx


def client_kwargs(cfg: MqttConfig, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Connection arguments for ``aiomqtt.Client(**client_kwargs(cfg), identifier=..., ...)``."""
    kwargs: dict[str, Any] = {
        "hostname": cfg.host,
        "port": cfg.port,
        "keepalive": cfg.keepalive_s,
        "timeout": timeout_s,
        "tls_context": tls_context(cfg),
    }
    if cfg.username is not None:
        kwargs["username"] = cfg.username
        kwargs["password"] = cfg.password.get_secret_value() if cfg.password else None
    return kwargs


class Client(aiomqtt.Client):
    """aiomqtt's client with a wait that keeps a cancellation it was sent.

    aiomqtt waits for acks, the connect and the disconnect with ``asyncio.wait_for``. On Python
    3.11 that returns the result instead of raising when a cancellation arrives in the loop
    iteration the awaited thing completes (CPython gh-86296, fixed in 3.12), and the task runs on
    as if nobody had cancelled it. The agent's event pump, cancelled as its last event's ack came
    in, went back to waiting on an empty outbox: its TaskGroup never exited and the agent never
    stopped after fleetd's shutdown command (agent_shutdown_stuck naming the mqtt task).
    ``fleetd.shared.waits.within`` (asyncio.timeout) has no such race."""

    async def _wait_for(self, fut: Awaitable[T], timeout: float | None) -> T:
        timeout = self.timeout if timeout is None else timeout
        if timeout == math.inf:
            return await fut
        try:
            return await within(fut, timeout)
        except TimeoutError:
            raise aiomqtt.MqttError("Operation timed out") from None
