"""The job file: one definition of a training job, read by the controller only.

A user writes it once (deploy/examples/job.toml is the commented example); fleetd.toml names it
(``[job] file``) or `fleetd demo --job FILE` runs it. The controller packs its workdir, uploads
the archive and puts the whole job, with the archive's digest, in the nodes' user data
(fleetd/adapters/launch_template.py), so no node needs a copy of this file and the job is never
defined twice.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetd.shared.settings import ConfigError, Name, problems_of


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSpec(_Part):
    """What torchrun starts on every node: a script in the workdir or a module."""

    script: str | None = None  # a path inside the workdir, e.g. "train.py"
    module: str | None = None  # e.g. "mypkg.train" (the workdir is on the import path)
    args: tuple[str, ...] = ()
    nproc_per_node: Annotated[int, Field(ge=1)] = 1
    # Modules the node's warm worker pool imports once (module entrypoints only).
    preload: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _one_entrypoint(self) -> RunSpec:
        if (self.script is None) == (self.module is None):
            raise ValueError("run needs exactly one of script or module")
        if self.script is not None and (Path(self.script).is_absolute() or ".." in Path(self.script).parts):
            raise ValueError(f"run.script {self.script!r} must be a path inside the workdir")
        return self


class CheckpointSpec(_Part):
    """How the job's state is saved. "library": fleetd's trainer library (agent.trainer);
    "callback": a framework callback (Hugging Face, Lightning); "folder": the script saves files
    to ``dir`` on its own and imports nothing from fleetd."""

    mode: Literal["library", "callback", "folder"] = "library"
    dir: Path | None = None  # folder mode: relative paths are inside the job's folder on the node
    signal: Literal["none", "SIGUSR1", "SIGTERM"] = "none"
    # Folder mode: a save is complete once nothing in the folder changed for this long and no
    # process of the job holds a file of it open for writing. Below the script's save interval.
    settle_s: Annotated[float, Field(gt=0, le=600)] = 2.0

    @model_validator(mode="after")
    def _folder_needs_dir(self) -> CheckpointSpec:
        if (self.mode == "folder") != (self.dir is not None):
            raise ValueError("checkpoint.dir is set in folder mode, and only there")
        return self


class JobBudget(_Part):
    """Overrides fleetd.toml's [budget] for this job, where given."""

    total_usd: Annotated[float, Field(gt=0)] | None = None
    max_usd_per_hour: Annotated[float, Field(gt=0)] | None = None


class JobFile(_Part):
    version: Literal[1] = 1
    name: Name
    workdir: Path = Path(".")  # relative to the job file
    setup: tuple[str, ...] = ()
    env: dict[str, str] = {}
    run: RunSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    total_steps: Annotated[int, Field(ge=1)] | None = None
    # Its expected pace at fleet.max_nodes (steps/s), used until fleetd has measured it (a deadline's
    # work left; a team move's payback while the job is paused).
    steps_per_s: Annotated[float, Field(gt=0)] | None = None
    deadline: AwareDatetime | None = None
    # Failures of the job's own code fleetd retries before the job FAILS.
    max_restarts: Annotated[int, Field(ge=0)] = 3
    budget: JobBudget = JobBudget()

    @model_validator(mode="after")
    def _deadline_needs_work(self) -> JobFile:
        if self.deadline is not None and self.total_steps is None:
            raise ValueError("a deadline needs total_steps (how much work is due by then)")
        return self

    def job_group(self, code_uri: str = "", code_digest: str = "") -> dict[str, Any]:
        """The controller's [job] settings (fleetd.config.FleetdJobConfig) for this job."""
        run = self.run
        group: dict[str, Any] = {
            "name": self.name,
            "entrypoint": run.module if run.module is not None else run.script,
            "module": run.module is not None,
            "args": run.args,
            "nproc_per_node": run.nproc_per_node,
            "preload": run.preload,
            "checkpoint_dir": self.checkpoint.dir,
            "checkpoint_signal": self.checkpoint.signal,
            "checkpoint_settle_s": self.checkpoint.settle_s,
            "setup": self.setup,
            "env": self.env,
            "code_uri": code_uri,
            "code_digest": code_digest,
            "total_steps": self.total_steps,
            "steps_per_s": self.steps_per_s,
            "max_restarts": self.max_restarts,
        }
        if self.deadline is not None:
            group["deadline"] = self.deadline
        return group


def load_job_file(path: Path) -> tuple[JobFile, Path]:
    """The job and its workdir (absolute). Raises ConfigError with every problem listed."""
    source = f"job file {path}"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(source, [("<file>", f"cannot read it: {exc.strerror or exc}")]) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [("<file>", f"not valid TOML: {exc}")]) from exc
    try:
        job = JobFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, problems_of(exc)) from exc
    workdir = job.workdir if job.workdir.is_absolute() else (path.parent / job.workdir)
    return job, workdir.resolve()
