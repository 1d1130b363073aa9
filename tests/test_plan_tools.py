"""The calculations behind `fleetd plan`, and the command itself."""

from __future__ import annotations

import json
import math
import sys

import pytest

from fleetd.cli import main
from fleetd.policy.model import PoolId
from fleetd.sim.planner_tools import (
    MULTIPART_PART_MB,
    S3_USD_PER_1K_PUT,
    S3_USD_PER_GB_MONTH,
    expected_overhead_share,
    interruptions_per_hour_from_bucket,
    plot_results,
    s3_checkpoint_cost,
    young_daly_interval_s,
)
from fleetd.sim.whatif import advisor_rate_per_hour


@pytest.mark.parametrize(
    "delta, mtbf, expected",
    [(5.0, 3600.0, math.sqrt(2 * 5 * 3600)), (60.0, 86400.0, 3220.0), (0.0, 100.0, 0.0), (10.0, 10.0, math.sqrt(200))],
)
def test_young_daly_is_sqrt_two_delta_mtbf(delta, mtbf, expected):
    assert young_daly_interval_s(delta, mtbf) == pytest.approx(expected, rel=1e-3)


def test_young_daly_minimises_the_first_order_overhead():
    delta, mtbf = 5.0, 4000.0
    best = young_daly_interval_s(delta, mtbf)
    at_best = expected_overhead_share(best, delta, mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert expected_overhead_share(best * factor, delta, mtbf) > at_best
    # At the optimum both halves are equal: delta/T == T/(2 MTBF).
    assert delta / best == pytest.approx(best / (2 * mtbf))


def test_young_daly_edge_cases():
    assert young_daly_interval_s(5.0, math.inf) == math.inf
    with pytest.raises(ValueError):
        young_daly_interval_s(-1.0, 100.0)
    with pytest.raises(ValueError):
        young_daly_interval_s(1.0, 0.0)


def test_s3_cost_counts_parts_and_kept_checkpoints():
    cost = s3_checkpoint_cost(checkpoint_gb=2.0, interval_s=600.0, run_s=10 * 3600.0, keep=3)
    parts = math.ceil(2.0 * 1024 / MULTIPART_PART_MB)
    assert cost.checkpoints == 60
    assert cost.put_requests == 60 * (parts + 3)
    assert cost.request_usd == pytest.approx(cost.put_requests / 1000 * S3_USD_PER_1K_PUT)
    assert cost.storage_usd == pytest.approx(3 * 2.0 * S3_USD_PER_GB_MONTH * 10 / 730)
    assert cost.total_usd == pytest.approx(cost.storage_usd + cost.request_usd)
    assert s3_checkpoint_cost(2.0, math.inf, 3600.0).checkpoints == 0


def test_bucket_rates_and_advisor_lookup():
    assert interruptions_per_hour_from_bucket(0.25) == pytest.approx(-math.log(0.75) / 730)
    # us-east-1 p3.2xlarge is in the >20 % bucket of the bundled snapshot; g4dn.xlarge in 15-20 %.
    assert advisor_rate_per_hour(PoolId("p3.2xlarge", "us-east-1a")) == pytest.approx(0.25 / 730)
    assert advisor_rate_per_hour(PoolId("g4dn.xlarge", "us-east-1b")) == pytest.approx(0.175 / 730)
    assert advisor_rate_per_hour(PoolId("x9.huge", "us-east-1a")) is None


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    # matplotlib is an optional extra (the test extra installs it): hide it as if absent.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install"):
        plot_results([], tmp_path / "x.png")
    assert main(["simulate", "--trace", "p3", "--plot", str(tmp_path / "y.png")]) == 2
    assert not (tmp_path / "y.png").exists()


def test_simulate_plots_nodes_spend_and_progress_per_policy(tmp_path, capsys):
    import matplotlib.image  # the test extra installs matplotlib

    png = tmp_path / "p3.png"
    assert main(["simulate", "--trace", "p3", "--plot", str(png)]) == 0
    image = matplotlib.image.imread(str(png))
    assert image.shape[0] == 900 and image.shape[1] == 900  # 9 x 9 in at 100 dpi: three panels
    assert image.std() > 0.05  # lines drawn, not a blank canvas
    assert "fleetd" in capsys.readouterr().out


def test_fleetd_plan_json_for_a_deadline_job(capsys):
    rc = main(
        [
            "plan",
            "--work-node-hours",
            "20",
            "--deadline-h",
            "24",
            "--offsets",
            "12",
            "--pools",
            "p3.2xlarge@us-east-1a,g4dn.xlarge@us-east-1a:0.5",
            "--trace-for",
            "p3.2xlarge@us-east-1a=p3",
            "--checkpoint-gb",
            "4",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    by_pool = {p["pool"]: p for p in out["pools"]}
    assert set(by_pool) == {"p3.2xlarge@us-east-1a", "g4dn.xlarge@us-east-1a"}
    p3, g4 = by_pool["p3.2xlarge@us-east-1a"], by_pool["g4dn.xlarge@us-east-1a"]
    assert p3["runs"] == g4["runs"] == 12
    # Half speed needs 40 h for 20 node-hours of work: it cannot make a 24 h deadline.
    assert g4["deadline_miss_risk"] == 1.0
    assert p3["deadline_miss_risk"] == 0.0
    assert p3["expected_cost_usd"] < p3["on_demand_cost_usd"]
    assert out["recommended_mix"] == [{"pool": "p3.2xlarge@us-east-1a", "share": 1.0}]
    assert out["s3"]["checkpoints"] > 0 and out["s3"]["total_usd"] > 0
    assert out["checkpoint_interval_s"] <= 600.0


def test_fleetd_plan_rejects_a_bad_pool(capsys):
    assert main(["plan", "--work-node-hours", "1", "--pools", "nozone"]) == 2
    assert "is not <instance-type>@<zone>" in capsys.readouterr().err
