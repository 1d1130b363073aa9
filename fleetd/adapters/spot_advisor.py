"""Read AWS Spot Advisor's interruption-frequency table (CSV snapshot) for the placement prior."""

from __future__ import annotations

import csv
from pathlib import Path

from fleetd.policy.placement import AdvisorRow


class SpotAdvisorError(ValueError):
    """The Spot Advisor CSV is malformed; the message names the file and the row."""


def load_spot_advisor(path: Path) -> list[AdvisorRow]:
    """Rows of ``region,instance_type,savings_vs_ondemand_pct,interruption_bucket_index,
    interruption_bucket`` (the format of shared/traces/aws_spot_advisor_gpu_snapshot_*.csv)."""
    rows: list[AdvisorRow] = []
    try:
        with path.open(newline="") as f:
            for n, rec in enumerate(csv.DictReader(f), start=2):
                try:
                    rows.append(
                        AdvisorRow(
                            region=rec["region"],
                            instance_type=rec["instance_type"],
                            savings_pct=float(rec["savings_vs_ondemand_pct"]),
                            bucket_index=int(rec["interruption_bucket_index"]),
                            bucket_label=rec.get("interruption_bucket", ""),
                        )
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    raise SpotAdvisorError(f"{path}: line {n}: {exc!r}") from None
    except OSError as exc:
        raise SpotAdvisorError(f"{path}: {exc}") from None
    return rows
