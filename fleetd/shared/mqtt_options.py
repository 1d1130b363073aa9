"""How both daemons connect to the broker: aiomqtt.Client keyword arguments from MqttConfig.

TLS uses the configured CA (or the system store) and, when given, a client certificate; a
username/password is sent only when configured. Kept here because the agent and the controller
must agree on it and the agent may import only fleetd.protocol.
"""

from __future__ import annotations

import ssl
from typing import Any

from fleetd.shared.settings import MqttConfig


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
