"""A node on another version of the job's code than the job's leaves (fleetd job submit, or a
restart of fleetd with a changed job file): one world never mixes two versions of the code.

Every such node is drained at once, like a wave of notices (its checkpoint made durable, then
it leaves), and the planner buys the replacements from the launch template, which carries the
new version, in the same pass. The job pauses for one changeover; replacing node by node would
keep training going, but on a world whose ranks run different code. A node whose version is
unknown (an agent that says nothing, code baked into the image) is left alone."""

from __future__ import annotations

from collections.abc import Iterable

from fleetd.policy.model import Drain, Node


def stale_code_drains(kept: Iterable[Node], code_digest: str) -> list[Drain]:
    if not code_digest:
        return []
    return [
        Drain(
            reason=(
                f"{n.instance_id} runs the job's code version {n.code_digest[:12]}, the job's is now "
                f"{code_digest[:12]}: checkpoint, upload, leave (new nodes start on the new version)"
            ),
            instance_id=n.instance_id,
        )
        for n in kept
        if n.code_digest and n.code_digest != code_digest
    ]
