"""The job file (fleetd/jobs/job_file.py): the one definition of a job, and how it becomes the
controller's [job] and the nodes' user data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetd.adapters.launch_template import agent_user_data, parse_user_data_env
from fleetd.config import FleetdConfig, FleetdJobConfig
from fleetd.jobs.job_file import load_job_file
from fleetd.jobs.publish import Published, apply_job
from fleetd.shared.settings import ConfigError, JobConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "ddp-job" / "job.toml"
DIGEST = "ab" * 32


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_the_shipped_example_reads_and_maps_onto_the_controllers_job() -> None:
    job, workdir = load_job_file(EXAMPLE)
    assert workdir == EXAMPLE.parent
    published = Published(f"s3://b/checkpoints/{job.name}/code/{DIGEST}.tar.gz", DIGEST, True, 4)
    cfg = apply_job(FleetdConfig(job=FleetdJobConfig(file=EXAMPLE)), job, published)
    assert cfg.job.entrypoint == "train.py" and cfg.job.module is False
    assert cfg.job.checkpoint_dir == Path("snapshots") and cfg.job.max_restarts == 2
    assert cfg.job.setup == ("python -m pip install --quiet -r requirements.txt",)
    assert cfg.job.code_digest == DIGEST and cfg.job.file == EXAMPLE


def test_the_whole_job_reaches_the_node_through_user_data() -> None:
    job, _ = load_job_file(EXAMPLE)
    published = Published(f"s3://b/k/{DIGEST}.tar.gz", DIGEST, True, 4)
    cfg = apply_job(FleetdConfig(job=FleetdJobConfig(file=EXAMPLE)), job, published)
    env = parse_user_data_env(agent_user_data(cfg))
    shipped = {k.removeprefix("FLEETD_JOB__").lower(): v for k, v in env.items() if k.startswith("FLEETD_JOB__")}
    # Every field the agent's JobConfig has (the example is a folder-mode job: its settle time too).
    assert set(shipped) == set(JobConfig.model_fields)
    node_job = JobConfig.model_validate(
        {k: json.loads(v) if v[:1] in "[{" or v in ("true", "false") else v for k, v in shipped.items()}
    )
    for name in shipped:
        assert getattr(node_job, name) == getattr(cfg.job, name), name


def test_the_agent_reads_the_job_from_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.config import load

    job, _ = load_job_file(EXAMPLE)
    cfg = apply_job(FleetdConfig(job=FleetdJobConfig(file=EXAMPLE)), job, Published("s3://b/k", DIGEST, True, 4))
    for key, value in parse_user_data_env(agent_user_data(cfg)).items():
        if key.startswith("FLEETD_JOB__"):
            monkeypatch.setenv(key, value)
    conf = tmp_path / "agent.toml"
    conf.write_text("")
    agent_cfg = load(conf)
    assert agent_cfg.job.code_digest == DIGEST and agent_cfg.job.env == {"OMP_NUM_THREADS": "1"}
    assert agent_cfg.job.setup == cfg.job.setup and agent_cfg.job.args == cfg.job.args


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('name = "j"\n[run]\nscript = "a.py"\nmodule = "m"\n', "run"),
        ('name = "j"\n[run]\n', "run"),
        ('name = "j"\n[run]\nscript = "../a.py"\n', "run"),
        ('name = "j"\n[run]\nscript = "a.py"\n[checkpoint]\nmode = "folder"\n', "checkpoint"),
        ('name = "j"\ndeadline = 2030-01-01T00:00:00Z\n[run]\nscript = "a.py"\n', "<root>"),
        ('name = "j"\nsteps = 3\n[run]\nscript = "a.py"\n', "steps"),
        ('version = 2\nname = "j"\n[run]\nscript = "a.py"\n', "version"),
        ('name = "bad name!"\n[run]\nscript = "a.py"\n', "name"),
    ],
)
def test_a_bad_job_file_is_refused_with_where_and_why(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_job_file(_write(tmp_path, text))
    assert any(path.startswith(where) for path, _ in err.value.problems), err.value.render()


def test_an_unreadable_or_broken_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_job_file(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_file(_write(tmp_path, "name = "))


def test_a_job_file_is_the_only_definition(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="defined in that file only"):
        FleetdJobConfig(file=tmp_path / "job.toml", entrypoint="x.py")
    assert FleetdJobConfig(file=tmp_path / "job.toml").file is not None


def test_the_job_files_budget_overrides_the_controllers(tmp_path: Path) -> None:
    path = _write(tmp_path, 'name = "j"\n[run]\nmodule = "m"\n[budget]\ntotal_usd = 7.5\n')
    job, _ = load_job_file(path)
    cfg = apply_job(FleetdConfig(), job, None)
    assert cfg.budget.total_usd == 7.5 and cfg.budget.max_usd_per_hour == FleetdConfig().budget.max_usd_per_hour
    assert cfg.job.module is True and cfg.job.entrypoint == "m" and cfg.job.code_uri == ""


def test_half_a_code_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="go together"):
        JobConfig(code_uri="s3://b/k")
    with pytest.raises(ValueError):
        JobConfig(code_uri="s3://b/k", code_digest="not-hex")


async def test_the_code_is_uploaded_once_per_version(tmp_path: Path, aws_client_kwargs: dict) -> None:
    """`fleetd run`'s start (fleetd/jobs/publish.py) against S3 on moto: packed, uploaded under
    the job's prefix named by its digest, not again for an unchanged workdir; the config the
    daemon then runs carries the job from the file with that version."""
    import shutil

    from aiobotocore.session import get_session

    from fleetd.jobs.publish import publish_job
    from fleetd.protocol.job_code import digest_of

    shutil.copytree(EXAMPLE.parent, tmp_path / "job")
    cfg = FleetdConfig(job=FleetdJobConfig(file=tmp_path / "job" / "job.toml"))
    cfg = cfg.model_copy(update={"checkpoints": cfg.checkpoints.model_copy(update={"bucket": "code-bucket"})})
    async with get_session().create_client("s3", **aws_client_kwargs) as s3:
        await s3.create_bucket(Bucket="code-bucket")
        shipped, first = await publish_job(cfg, s3)
        again, second = await publish_job(cfg, s3)
        (tmp_path / "job" / "train.py").write_text((tmp_path / "job" / "train.py").read_text() + "\n# v2\n")
        _, third = await publish_job(cfg, s3)
        key = f"checkpoints/ddp-tutorial/code/{first.digest}.tar.gz"
        body = await (await s3.get_object(Bucket="code-bucket", Key=key))["Body"].read()
    assert first.uploaded and not second.uploaded and third.uploaded
    assert second.digest == first.digest != third.digest
    assert digest_of(body) == first.digest and first.uri == f"s3://code-bucket/{key}"
    assert shipped.job.code_uri == first.uri and shipped.job.code_digest == first.digest
    assert shipped.job.entrypoint == "train.py" and again.job == shipped.job


def test_job_check_shows_what_ships_or_why_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleetd.cli import main

    assert main(["job", "check", str(EXAMPLE), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["run"] == "train.py" and shown["files"] == 4 and shown["ignore_file"] == ".gitignore"
    assert len(shown["digest"]) == 64
    (tmp_path / "agent.py").write_text("")
    (tmp_path / "job.toml").write_text('name = "j"\n[run]\nscript = "agent.py"\n')
    assert main(["job", "check", str(tmp_path / "job.toml")]) == 2
    assert "rename it" in capsys.readouterr().err


def test_every_command_names_the_job_as_its_file_does(tmp_path: Path) -> None:
    """`fleetd logs`, status and report read fleetd.toml without packing the job file: the job's
    name still comes from the file (its logs live under that name), not from the default."""
    from fleetd.config import load

    conf = tmp_path / "fleetd.toml"
    conf.write_text(f'[job]\nfile = "{EXAMPLE}"\n')
    assert load(conf).job.name == "ddp-tutorial"
    conf.write_text(f'[job]\nfile = "{tmp_path / "missing.toml"}"\n')
    assert load(conf).job.name == "train"  # unreadable: `fleetd run` reports it, with its reason
