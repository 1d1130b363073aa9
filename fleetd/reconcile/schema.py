"""The state DB's schema version (SQLite ``PRAGMA user_version``) and its migrations.

``<state_dir>/fleetd.db`` outlives builds, so the file says which schema it has. An older file is
migrated on open, step by step, in one transaction (a crash mid-migration leaves the old version;
every step is idempotent); a newer one is refused with :class:`SchemaTooNew`: an old build must not
write rows whose meaning it does not know (docs/DESIGN.md "Start-up and the production path"). The
stores create the tables first, so a new file too is created at version 0 and migrated.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from fleetd.shared.logs import get_logger

log = get_logger(__name__)


class SchemaTooNew(Exception):
    """The state DB was written by a newer fleetd; this build refuses to touch it."""

    def __init__(self, path: Path | str, found: int, supported: int):
        self.path, self.found, self.supported = str(path), found, supported
        super().__init__(
            f"state DB {path} has schema version {found}, newer than this build's {supported}: it was "
            f"written by a newer fleetd. Run that build (or newer), or point fleet.state_dir at another directory."
        )


def _add_columns(db: sqlite3.Connection, table: str, columns: tuple[tuple[str, str], ...]) -> None:
    have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    for name, sql_type in columns:
        if name not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type}")


# Version 0: no version written (every DB before versions); the column below may be missing (it
# was added to existing DBs ad hoc, at open). Version 1 guarantees it.
def _to_1(db: sqlite3.Connection) -> None:
    _add_columns(db, "pool_stats", (("on_demand_capacity_error_until", "REAL"),))


# Version 2: the drain journal (fleetd.reconcile.journal), so a drain decided before a crash is
# sent exactly once after it.
def _to_2(db: sqlite3.Connection) -> None:
    _add_columns(db, "instances", (("drain_deadline", "REAL"), ("drain_reason", "TEXT"), ("drain_sent_at", "REAL")))
    # A drain recorded by an older build was recorded after it was sent: it counts as sent.
    db.execute(
        "UPDATE instances SET drain_sent_at=drain_started_at WHERE drain_started_at IS NOT NULL"
        " AND drain_sent_at IS NULL"
    )


# MIGRATIONS[n] takes a version-n DB to version n+1.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_1, _to_2)
CURRENT_VERSION = len(MIGRATIONS)


def version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def refuse_newer(db: sqlite3.Connection, path: Path | str) -> int:
    """Raise SchemaTooNew for a DB written by a newer build; returns the version found. Call it
    before anything writes to the file."""
    found = version(db)
    if found > CURRENT_VERSION:
        raise SchemaTooNew(path, found, CURRENT_VERSION)
    return found


def migrate(db: sqlite3.Connection, path: Path | str) -> int:
    """Bring an older DB to CURRENT_VERSION (autocommit connection); returns the version found."""
    found = refuse_newer(db, path)
    if found == CURRENT_VERSION:
        return found
    db.execute("BEGIN IMMEDIATE")
    try:
        # Read again under the write lock: another process may have migrated it meanwhile.
        at = refuse_newer(db, path)
        for step in MIGRATIONS[at:]:
            step(db)
        db.execute(f"PRAGMA user_version = {CURRENT_VERSION}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    log.info("state_db_migrated", path=str(path), from_version=found, to_version=CURRENT_VERSION)
    return found
