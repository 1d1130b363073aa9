"""What carrying out one planned action came to, and the counters that count it (one module
so the executor and the launch book share them without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from fleetd.adapters.aws_errors import AwsError
from fleetd.policy.model import Action

AWS_ERRORS = Counter("fleetd_aws_errors_total", "AWS calls that failed, by kind", ["operation", "kind", "code"])
ACTIONS = Counter("fleetd_actions_total", "Planned actions by kind and outcome", ["action", "outcome"])


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    status: str  # done | partial | failed | held | dry-run
    detail: str = ""
    instance_ids: tuple[str, ...] = ()


def count_aws_error(exc: AwsError, kind: str | None = None) -> None:
    AWS_ERRORS.labels(exc.operation, kind or exc.kind, exc.code).inc()
