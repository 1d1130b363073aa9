"""`fleetd report --plot FILE.png`: spend, live nodes by market and training progress over time,
with each scaling decision marked. matplotlib is an optional extra, imported only here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a control host
import matplotlib.pyplot as plt  # noqa: E402

from fleetd.policy.ledger_events import LedgerEvent  # noqa: E402
from fleetd.policy.ledger_timeline import timeline  # noqa: E402


def plot(events: Sequence[LedgerEvent], now: float, observed_until: Mapping[str, float], out: Path) -> Path:
    tl = timeline(events, now, observed_until)
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    if not tl.times:
        axes[0].set_title("fleetd: no instance in the ledger yet")
        fig.savefig(out)
        plt.close(fig)
        return out
    t0 = tl.times[0]
    minutes = [(t - t0) / 60.0 for t in tl.times]
    axes[0].plot(minutes, tl.spend_usd, color="tab:red")
    axes[0].set_ylabel("spend (USD)")
    axes[0].set_title("fleetd: spend, nodes and progress (from the ledger)")
    for market, counts in sorted(tl.nodes_by_market.items()):
        axes[1].step(minutes, counts, where="post", label=market)
    axes[1].set_ylabel("live nodes")
    axes[1].legend(loc="upper left")
    axes[2].plot(minutes, tl.step, color="tab:green", label="useful steps (highest step reached)")
    for lost in tl.losses:
        x = (lost.at - t0) / 60.0
        axes[2].axvline(x, color="tab:red", linewidth=1)
        axes[2].annotate(
            f"-{lost.from_step - lost.to_step} steps",
            (x, lost.to_step),
            textcoords="offset points",
            xytext=(2, 2),
            fontsize=7,
            color="tab:red",
        )
    axes[2].set_ylabel("training step")
    axes[2].legend(loc="upper left")
    axes[2].set_xlabel("minutes since the first launch")
    for d in tl.decisions:
        x = (d.at - t0) / 60.0
        for ax in axes:
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        axes[1].annotate(
            f"{d.previous}->{d.target}", (x, 0), textcoords="offset points", xytext=(2, 2), fontsize=7, color="grey"
        )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
