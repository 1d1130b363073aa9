"""Which key each instance enrolled with, and until when its certificate runs (rules.Binding).

Persisted (state_dir/enrolments.json, atomic) so a controller restart does not reopen the
first-enrolment window to a replayed document while a node's certificate is still live.
"""

from __future__ import annotations

import json
from pathlib import Path

from fleetd.atomic_file import write_atomically
from fleetd.identity.rules import Binding
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
KEEP_EXPIRED_S = 86400.0  # an expired binding still lets its key holder renew for a day


class BindingStore:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._by_instance: dict[str, Binding] = {}
        if path is not None and path.exists():
            try:
                raw = json.loads(path.read_text())
                self._by_instance = {iid: Binding(v["key"], float(v["not_after"])) for iid, v in raw.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                # Losing bindings only narrows who may renew (a node re-enrols by document age).
                log.error("enrolments_unreadable", path=str(path), error=str(exc))

    def get(self, instance_id: str) -> Binding | None:
        return self._by_instance.get(instance_id)

    def put(self, instance_id: str, binding: Binding, now: float) -> None:
        self._by_instance[instance_id] = binding
        self._by_instance = {i: b for i, b in self._by_instance.items() if b.not_after > now - KEEP_EXPIRED_S}
        if self.path is not None:
            data = {i: {"key": b.key_fingerprint, "not_after": b.not_after} for i, b in self._by_instance.items()}
            write_atomically(self.path, json.dumps(data, sort_keys=True).encode(), mode=0o600)
