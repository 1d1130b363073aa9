"""Who gets a node certificate: a pure judgement over plain facts (no I/O, ``now`` passed in).

The facts: the verified instance identity document, EC2's state of that instance (None when it
lacks this fleet's tag or does not exist), the key and expiry of the certificate last issued for
it, and the public key in the request. A first enrolment needs a young document; after it only
the bound key renews.
(docs/DESIGN.md "Node identity and the threat model (fleetd/identity, agent/node/enrol.py)")
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.protocol.enrol import IdentityDocument

CLOCK_SKEW_S = 300.0  # a document from the future by more than this is not believed


@dataclass(frozen=True)
class EnrolSettings:
    region: str
    cert_lifetime_s: float = 3600.0
    max_document_age_s: float = 900.0


@dataclass(frozen=True)
class Binding:
    key_fingerprint: str  # sha256 of the DER public key the last certificate was issued for
    not_after: float  # epoch seconds


def judge(
    doc: IdentityDocument,
    ec2_state: str | None,
    binding: Binding | None,
    key_fingerprint: str,
    now: float,
    s: EnrolSettings,
) -> str | None:
    """None: issue a certificate; otherwise the reason it is refused (logged and returned)."""
    if doc.region != s.region:
        return f"document is for region {doc.region}, this fleet runs in {s.region}"
    if ec2_state is None:
        return f"{doc.instance_id} is not an instance of this fleet (no such instance with the fleet's tag)"
    if ec2_state != "running":
        return f"{doc.instance_id} is {ec2_state} in EC2, not running"
    if binding is not None and binding.key_fingerprint == key_fingerprint:
        # The CSR is signed with the bound key, so only its holder renews (trust on first use, as
        # Vault's aws-ec2 method does with its client nonce).
        return None  # renewal by the key holder
    if binding is not None and binding.not_after > now:
        return f"a live certificate was already issued for {doc.instance_id} (to another key)"
    # A document is static for the instance's whole life and anyone who once read it can send it
    # again: it proves little after the node's first minutes.
    age = now - doc.pending_time.timestamp()
    if age < -CLOCK_SKEW_S:
        return f"document pendingTime is {-age:.0f} s in the future"
    if age > s.max_document_age_s:
        return (
            f"document is {age:.0f} s old (pendingTime), over the {s.max_document_age_s:.0f} s allowed "
            f"for a first enrolment: a replayed document earns nothing"
        )
    return None
