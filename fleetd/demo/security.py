"""The demo's PKI, made the way production's is: ``LocalCa.init`` (what ``fleetd ca init`` runs)
creates the fleet CA, the broker's server certificate and the controller's client certificate; a
throwaway RSA key plays AWS's instance identity signer (the fake IMDS signs with it, fleetd is
configured with its certificate). Nodes get their certificates by enrolling, like real ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.doubles.fake_iid import IdentitySigner
from fleetd.identity.ca import CONTROLLER_CN, OBSERVER_CN, CaFiles, LocalCa
from fleetd.shared.settings import MqttConfig

# Every address a demo process may reach the broker on (node aliases of the partition harness
# included), so the broker's certificate verifies whichever one a client dials.
SERVER_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class DemoPki:
    files: CaFiles
    identity_certificate: Path  # "AWS's" public certificate, as fleetd.toml [enrol] names it
    signer: IdentitySigner  # its private half: only the fake IMDS holds it

    @classmethod
    def create(cls, workdir: Path, controllers: tuple[str, ...] = ()) -> DemoPki:
        """``controllers``: one more controller identity per name (CN=fleetd-controller-NAME), for
        controllers sharing the broker (the team demo's jobs): one certificate between them would
        have the broker close each one's session when the next connects."""
        from fleetd.identity.acl import controller_cn

        directory = workdir / "pki"
        directory.mkdir(parents=True, exist_ok=True)
        clients = (CONTROLLER_CN, OBSERVER_CN, *(controller_cn(c) for c in controllers))
        LocalCa.init(directory, server_names=SERVER_NAMES, clients=clients)
        signer = IdentitySigner.generate()
        cert = signer.write_certificate(directory / "aws-identity-rsa.pem")
        return cls(CaFiles(directory), cert, signer)

    def client_mqtt(self, url: str, cn: str) -> dict[str, object]:
        crt, key = self.files.client(cn)
        return {"url": url, "ca_file": self.files.ca_cert, "cert_file": crt, "key_file": key}

    def controller_mqtt(self, url: str) -> dict[str, object]:
        return self.client_mqtt(url, CONTROLLER_CN)

    def observer(self, url: str) -> MqttConfig:
        """The demo's live view: reads the fleet's topics, may publish nothing (ACL)."""
        return MqttConfig(**self.client_mqtt(url, OBSERVER_CN))  # type: ignore[arg-type]
