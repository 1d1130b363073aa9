"""One line per check: ok, or what is wrong and how to fix it. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    OK = "ok"
    FAIL = "FAIL"
    WARN = "warn"  # worth knowing; fleetd runs anyway
    SKIP = "skip"  # not applicable to this config


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    fatal: bool = False  # `fleetd run` refuses to start on this failure

    @classmethod
    def ok(cls, name: str, detail: str) -> Check:
        return cls(name, Status.OK, detail)

    @classmethod
    def fail(cls, name: str, detail: str, fix: str, *, fatal: bool = False) -> Check:
        return cls(name, Status.FAIL, detail, fix, fatal)

    @classmethod
    def warn(cls, name: str, detail: str, fix: str = "") -> Check:
        return cls(name, Status.WARN, detail, fix)

    @classmethod
    def skip(cls, name: str, why: str) -> Check:
        return cls(name, Status.SKIP, why)

    def line(self) -> str:
        text = f"{self.status.value:<4}  {self.name}: {self.detail}"
        return f"{text}\n      fix: {self.fix}" if self.fix and self.status in (Status.FAIL, Status.WARN) else text

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, "fix": self.fix}


def render(checks: Iterable[Check]) -> str:
    return "\n".join(c.line() for c in checks)


def exit_code(checks: Iterable[Check]) -> int:
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def fatal(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.status is Status.FAIL and c.fatal]
