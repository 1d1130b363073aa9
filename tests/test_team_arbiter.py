"""``fleetd team``'s pass over jobs read from disk (fleetd/team/arbiter.py): a job that cannot be
read is skipped with the reason while the others get their allotments; ``team plan`` writes
nothing; a config error is a clear message."""

from __future__ import annotations

from pathlib import Path

from fleetd.cli import main
from fleetd.snapshot import BudgetView, PoolView, StatusSnapshot, write_snapshot
from fleetd.team.allotment_file import read_allotment
from fleetd.team.arbiter import team_pass
from fleetd.team.config import load_team


def job(tmp_path: Path, name: str, member: bool = True, written_at: float = 1000.0) -> Path:
    state = tmp_path / name
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'[aws]\nregion = "us-east-1"\n[fleet]\nname = "{name}"\nmin_nodes = 1\nmax_nodes = 2\nstate_dir = "{state}"\n'
        f"[team]\nmember = {'true' if member else 'false'}\n"
        # A job outside the team may spend what its own budget allows: the team keeps that aside.
        + ("" if member else "[budget]\ntotal_usd = 5.0\nmax_usd_per_hour = 1.0\n")
    )
    write_snapshot(
        state,
        StatusSnapshot(
            fleet=name,
            written_at=written_at,
            reconcile_interval_s=10.0,
            pools=(
                PoolView(pool="g5.xlarge@us-east-1a", offered=True, spot_price=0.4, relative_throughput=1.0, gpus=1),
            ),
            budget=BudgetView(
                total_usd=100.0,
                max_usd_per_hour=20.0,
                spent_usd=1.0,
                burn_usd_per_hour=0.0,
                forecast_usd=1.0,
                level="normal",
            ),
        ),
    )
    return path


def team_toml(tmp_path: Path, jobs: dict[str, Path]) -> Path:
    entries = "".join(
        f'[[jobs]]\nname = "{n}"\nconfig = "{p}"\npriority = {i}\n' for i, (n, p) in enumerate(jobs.items())
    )
    path = tmp_path / "team.toml"
    path.write_text(f'[team]\nname = "lab"\ntotal_usd = 30\nmax_usd_per_hour = 5\n{entries}')
    return path


async def test_a_job_that_cannot_be_read_is_skipped_with_the_reason_and_the_others_go_on(tmp_path: Path) -> None:
    jobs = {"a": job(tmp_path, "a"), "b": job(tmp_path, "b", member=False), "c": tmp_path / "missing.toml"}
    cfg = load_team(team_toml(tmp_path, jobs))
    done = await team_pass(cfg, now=1000.0)
    assert [r.job for r in done.written] == ["a"]
    assert "member = true" in done.skipped["b"] and "does not exist" in done.skipped["c"]
    assert done.spend_unknown == ("c",)  # c's config names no state: its spend is not counted, and said so
    written = read_allotment(tmp_path / "a")
    assert written is not None and written.kind == "start" and written.nodes == 2 and written.team == "lab"
    assert done.spent_usd == 2.0  # a and b spent $1 each: both count
    # b does not follow the team: the $5 its own budget allows is kept aside, a shares the rest.
    assert written.total_usd <= 30.0 - 5.0 + 1e-9
    assert read_allotment(tmp_path / "b") is None


def test_team_plan_prints_and_writes_nothing_and_a_bad_config_is_one_clear_message(tmp_path: Path, capsys) -> None:
    import time

    path = team_toml(tmp_path, {"a": job(tmp_path, "a", written_at=time.time())})
    assert main(["team", "plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "team lab: spent $1.00 of $30.00" in out and "start 2 node(s)" in out
    assert read_allotment(tmp_path / "a") is None
    path.write_text('[team]\nname = "lab"\ntotal_usd = -1\nmax_usd_per_hour = 5\njobs = []\n')
    assert main(["team", "status", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "team.total_usd" in err and "jobs" in err


def test_team_run_allots_every_interval_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from fleetd.localnet import free_port

    port = free_port()
    path = team_toml(tmp_path, {"a": job(tmp_path, "a", written_at=time.time())})
    settings = f"max_usd_per_hour = 5\ninterval_s = 0.2\nmetrics_port = {port}\n"
    path.write_text(path.read_text().replace("max_usd_per_hour = 5\n", settings, 1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetd.cli", "team", "run", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = None
        deadline = time.monotonic() + 60  # a cold interpreter on a loaded box; the check is the file
        while time.monotonic() < deadline:
            record = read_allotment(tmp_path / "a")
            if first is None and record is not None:
                first = record.written_at
            if first is not None and record is not None and record.written_at > first:
                break  # a second pass rewrote it
            time.sleep(0.05)
        assert first is not None and record is not None and record.written_at > first
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            scrape = resp.read().decode()
        assert 'fleetd_team_budget_usd{team="lab"} 30.0' in scrape
        assert 'fleetd_team_job_allotted_nodes{job="a",team="lab"} 2.0' in scrape
        assert 'fleetd_team_job_spent_usd{job="a",team="lab"} 1.0' in scrape
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "team_stopped" in out and "team_pass" in out


def test_the_example_team_config_loads_documents_every_setting_and_matches_the_units() -> None:
    from fleetd.team.config import TeamGroup, TeamJobEntry

    root = Path(__file__).resolve().parent.parent
    text = (root / "deploy/examples/team.toml").read_text()
    cfg = load_team(root / "deploy/examples/team.toml")
    for model in (TeamGroup, TeamJobEntry):
        missing = [name for name in model.model_fields if f"{name} =" not in text]
        assert not missing, missing
    # fleetd@NAME keeps its state in /var/lib/fleetd/NAME (systemd/fleetd@.service).
    assert all(str(j.state_dir) == f"/var/lib/fleetd/{j.name}" for j in cfg.jobs)
    assert all(str(j.config) == f"/etc/fleetd/{j.name}.toml" for j in cfg.jobs)
