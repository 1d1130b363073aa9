"""Config groups shared by the controller and the agent, and the one loader both use.

Config is input from another party (an operator's TOML file and environment), so it lives with the
other boundary contracts: it is validated strictly (unknown keys are errors) and reported field by
field, never with a traceback. Precedence: environment (``FLEETD_`` prefix, ``__`` for nesting)
over the TOML file over defaults.
"""

from __future__ import annotations

import contextvars
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

NonEmpty = Annotated[str, Field(min_length=1)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Group(BaseModel):
    """Base of every config group: frozen, and unknown keys are errors (typos must not pass)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AwsConfig(Group):
    # Empty: AWS_REGION, AWS_DEFAULT_REGION, the profile's region, else (on EC2) the instance's
    # (fleetd/shared/aws_region.py). Never a silent default.
    region: str = ""
    # moto server, LocalStack or any S3/EC2-compatible endpoint; None means real AWS.
    endpoint_url: str | None = None
    profile: str | None = None
    # Where the region came from (filled in by fleetd; `fleetd doctor` shows it).
    region_source: str = ""

    @model_validator(mode="before")
    @classmethod
    def _find_region(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("region_source"):
            return data
        if data.get("region"):
            return {**data, "region_source": "config"}
        from fleetd.shared.aws_region import LOCAL_DEFAULT, region_from_environment

        found = region_from_environment()
        if found is not None:
            return {**data, "region": found[0], "region_source": found[1]}
        if data.get("endpoint_url"):
            return {**data, "region": LOCAL_DEFAULT, "region_source": "local endpoint default"}
        return data  # the profile or the instance, asked at start (fleetd/adapters/region.py), or refused

    def with_region(self, region: str, source: str) -> AwsConfig:
        return self.model_copy(update={"region": region, "region_source": source})

    def missing_region(self) -> str:
        return (
            "no AWS region: set [aws] region (or FLEETD_AWS__REGION), AWS_REGION, a region in the "
            "profile's ~/.aws/config, or run on an EC2 instance (its own region is used)"
        )


class MqttConfig(Group):
    url: NonEmpty = Field(default="mqtt://127.0.0.1:1883", description="mqtt://host:port or mqtts://host:port")
    username: str | None = None
    password: SecretStr | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    keepalive_s: Annotated[int, Field(ge=5, le=3600)] = 15
    # The other broker(s) of a bridged pair (DESIGN.md, "High availability"): when a connection to
    # the broker in use fails or is lost, the client tries the next one in [url, *fallback_urls]
    # and stays on whichever answers (no fail-back while it works). Same credentials and CA.
    fallback_urls: tuple[NonEmpty, ...] = ()

    @model_validator(mode="after")
    def _cert_pair(self) -> MqttConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        for url in (self.url, *self.fallback_urls):
            if not (url.startswith("mqtt://") or url.startswith("mqtts://")):
                raise ValueError("url and fallback_urls must start with mqtt:// or mqtts://")
        return self

    def broker(self, attempt: int) -> MqttConfig:
        """The settings for connection attempt ``attempt`` (0, 1, ...): the brokers in turn."""
        urls = (self.url, *self.fallback_urls)
        url = urls[attempt % len(urls)]
        return self if url == self.url else self.model_copy(update={"url": url})

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        rest = self.url.split("://", 1)[1]
        if ":" in rest:
            return int(rest.rsplit(":", 1)[1].rstrip("/"))
        return 8883 if self.url.startswith("mqtts://") else 1883

    @property
    def tls(self) -> bool:
        return self.url.startswith("mqtts://") or self.ca_file is not None


class RendezvousConfig(Group):
    # Where the rendezvous host binds (control host) / where nodes reach it (agents).
    host: NonEmpty = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 29400
    run_id: Name = "fleetd"
    join_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # torchrun's default is 30 s; fleetd completes rounds itself, so a short last call is safe.
    last_call_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    heartbeat_s: Annotated[float, Field(gt=0)] = 2.0
    close_timeout_s: Annotated[float, Field(gt=0)] = 10.0


class CheckpointConfig(Group):
    bucket: Name = "fleetd-checkpoints"
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_./-]*$")] = "checkpoints"
    keep: Annotated[int, Field(ge=1)] = 3
    interval_steps: Annotated[int, Field(ge=1)] = 100
    local_dir: Path = Path("/var/lib/fleet-agent/checkpoints")
    # Parts in flight at once across all files (memory: upload_concurrency x part size).
    upload_concurrency: Annotated[int, Field(ge=1, le=64)] = 8
    # 0: chosen per file for throughput (8 MiB; more only past 10,000 parts); else a fixed size
    # in MiB (S3's minimum part size is 5 MiB).
    part_size_mb: Annotated[int, Field(ge=0, le=5120)] = 0

    @model_validator(mode="after")
    def _part_size(self) -> CheckpointConfig:
        if 0 < self.part_size_mb < 5:
            raise ValueError("part_size_mb must be 0 (auto) or >= 5 (S3's minimum part size)")
        return self


class JobConfig(Group):
    name: Name = "train"
    entrypoint: NonEmpty = "agent.examples.toy_job.train_toy"
    args: tuple[str, ...] = ()
    nproc_per_node: Annotated[int, Field(ge=1)] = 1
    # run `python -m <entrypoint>` when True, else treat it as a script path
    module: bool = True
    # Folder mode (a script that only saves to a folder, no fleetd code): the folder it saves its
    # checkpoints in. The agent restores the newest durable copy into it before torchrun starts
    # and uploads every complete version the script writes there. Unset: the script uses fleetd's
    # trainer library (agent.trainer) or a framework callback.
    checkpoint_dir: Path | None = None
    # Folder mode: the signal the training processes get on a notice, for a script that saves when
    # told ("none": not told; the script's own interval is what is kept).
    checkpoint_signal: Literal["none", "SIGUSR1", "SIGTERM"] = "none"
    # Folder mode: a file counts as complete once its size and mtime were stable this long and no
    # process of the job holds it open for writing.
    checkpoint_settle_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    # Modules the node's warm worker pool imports once (e.g. ["transformers"]), so a worker restarted
    # by a membership change starts in milliseconds, not after a cold import. Fork-safe imports only:
    # with "lightning" preloaded, a torchrun forked from the pool hung at its first re-rendezvous.
    preload: tuple[str, ...] = ()
    # The job's own code (a job file's workdir, packed by the controller: fleetd/protocol/job_code.py).
    # Set by the controller in the nodes' user data, never by hand: ``s3://bucket/key`` and the
    # archive's SHA-256. Empty: the entrypoint is already on the node (baked into the image).
    code_uri: str = ""
    code_digest: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""
    # Shell commands run once per node and code version, in the job's folder and virtualenv,
    # before the first torchrun (e.g. "pip install -r requirements.txt"). A failure is the job's
    # failure (retried like a crash of its code), with the command's last lines as the reason.
    setup: tuple[str, ...] = ()
    # Extra environment for setup and for the training processes.
    env: dict[str, str] = {}

    @model_validator(mode="after")
    def _code_whole(self) -> JobConfig:
        if bool(self.code_uri) != bool(self.code_digest):
            raise ValueError("job.code_uri and job.code_digest go together (the controller sets both)")
        return self


class LoggingConfig(Group):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # None: JSON lines when stdout is not a terminal (journald), readable text on a terminal.
    json_lines: bool | None = Field(default=None, alias="json")


_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("config_file", default=None)


class FileSettings(BaseSettings):
    """BaseSettings whose sources are: environment, then the TOML file named at load time."""

    model_config = SettingsConfigDict(env_prefix="FLEETD_", env_nested_delimiter="__", extra="forbid", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _CONFIG_FILE.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)


class CommonSettings(FileSettings):
    """The groups both daemons read: how to reach AWS, the broker and the rendezvous, where
    checkpoints live, what the job runs, and how to log."""

    aws: AwsConfig = AwsConfig()
    mqtt: MqttConfig = MqttConfig()
    rendezvous: RendezvousConfig = RendezvousConfig()
    checkpoints: CheckpointConfig = CheckpointConfig()
    job: JobConfig = JobConfig()
    logging: LoggingConfig = LoggingConfig()


S = TypeVar("S", bound=FileSettings)


class ConfigError(Exception):
    """The config could not be loaded; ``problems`` holds one (path, reason) per invalid field."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"invalid configuration ({self.source}):"]
        lines += [f"  {path}: {reason}" for path, reason in self.problems]
        return "\n".join(lines)


_REASONS = {
    "extra_forbidden": "unknown key (not a setting of this version; check the spelling)",
    "missing": "required but not set",
}


def problems_of(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors(include_url=False):
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = _REASONS.get(e["type"], e["msg"])
        if e["type"] not in _REASONS and "input" in e and not isinstance(e["input"], (dict, list)):
            reason = f"{reason} (got {e['input']!r})"
        out.append((path, reason))
    return out


def load_settings(cls: type[S], path: Path | None, **overrides: Any) -> S:
    """Load ``cls`` from the TOML file at ``path`` (None: environment and defaults only).

    Raises ConfigError listing every invalid field; never a bare ValidationError or traceback.
    """
    source = str(path) if path is not None else "environment and defaults"
    if path is not None:
        if not path.is_file():
            raise ConfigError(source, [("<file>", f"config file {path} does not exist")])
        try:
            tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(source, [("<file>", f"not valid TOML: {exc}")]) from None
    token = _CONFIG_FILE.set(path)
    try:
        return cls(**overrides)
    except ValidationError as err:
        raise ConfigError(source, problems_of(err)) from None
    finally:
        _CONFIG_FILE.reset(token)


def redacted_dump(settings: BaseModel) -> dict[str, Any]:
    """The effective config as plain JSON-able data; SecretStr values print as '**********'."""
    return settings.model_dump(mode="json")


def config_check(cls: type[FileSettings], path: Path | None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Shared body of ``fleetd config check`` and ``fleet-agent config check``: exit 0 or 2."""
    import json

    try:
        settings = load_settings(cls, path)
    except ConfigError as exc:
        print(exc.render(), file=err)
        return 2
    print(json.dumps(redacted_dump(settings), indent=2, sort_keys=True), file=out)
    return 0
