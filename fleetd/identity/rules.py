"""Who gets a node certificate: a pure judgement over plain facts (no I/O, ``now`` passed in).

The facts: the verified instance identity document, what EC2 says about that instance (its state
when it carries this fleet's tag, None when it does not or does not exist), the certificate this
controller last issued for it (the public key it bound and when that certificate ends), and the
public key in the new request.

Replays: a document is static for an instance's whole life and anyone who once read it can send
it again, so the document alone proves little after the node's first minutes. First enrolment is
therefore allowed only while the document is young (``max_document_age_s`` after pendingTime);
from then on the instance is bound to the key it enrolled with (trust on first use, as Vault's
aws-ec2 method does with its client nonce), and only a request for that same key, i.e. from the
holder of that private key (the CSR is signed with it), renews. A replayed document with another
key is refused while a certificate is live, and after that by its age.
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
        return None  # renewal by the key holder
    if binding is not None and binding.not_after > now:
        return f"a live certificate was already issued for {doc.instance_id} (to another key)"
    age = now - doc.pending_time.timestamp()
    if age < -CLOCK_SKEW_S:
        return f"document pendingTime is {-age:.0f} s in the future"
    if age > s.max_document_age_s:
        return (
            f"document is {age:.0f} s old (pendingTime), over the {s.max_document_age_s:.0f} s allowed "
            f"for a first enrolment: a replayed document earns nothing"
        )
    return None
