"""fleetd's configuration: /etc/fleetd/fleetd.toml plus FLEETD_* environment overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AwareDatetime, Field, model_validator

from fleetd.shared.settings import CommonSettings, Group, JobConfig, Name, load_settings

if TYPE_CHECKING:
    from fleetd.policy.job_state import JobSettings
    from fleetd.policy.stall import StallSettings

DEFAULT_PATH = Path("/etc/fleetd/fleetd.toml")
Fraction = Annotated[float, Field(gt=0, le=1)]
PositiveUsd = Annotated[float, Field(gt=0)]


class FleetConfig(Group):
    name: Name = "default"
    min_nodes: Annotated[int, Field(ge=0)] = 1
    max_nodes: Annotated[int, Field(ge=1)] = 4
    state_dir: Path = Path("/var/lib/fleetd")
    reconcile_interval_s: Annotated[float, Field(gt=0)] = 10.0
    # Copy the state DB to the checkpoint bucket this often (fleetd/state_backup.py); restored
    # at start when the local DB is missing. 0: off.
    state_backup_interval_s: Annotated[float, Field(ge=0)] = 300.0

    @model_validator(mode="after")
    def _bounds(self) -> FleetConfig:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be <= max_nodes ({self.max_nodes})")
        return self


class GpuRequirements(Group):
    count: Annotated[int, Field(ge=1)] = 1
    models: tuple[str, ...] = ()  # e.g. ("A10G", "L4"); empty means any
    min_memory_gib: Annotated[float, Field(ge=0)] = 0.0


class CapacityConfig(Group):
    instance_types: tuple[str, ...] = ()
    gpu: GpuRequirements | None = None
    zones: tuple[str, ...] = ()
    # When fleetd may buy on-demand nodes (always inside the budget; never at budget level
    # forbid-on-demand or above):
    # - "never": spot only; a shortage waits for spot (the deadline may be missed);
    # - "deadline" (default): only when job.deadline asks for it (behind Uniform Progress's line,
    #   or inside its safety net; fleetd/policy/deadline.py). Without a deadline: spot only.
    # - "hold_size": also to hold the fleet at its target size when spot is short for
    #   spot_wait_s (the job runs on, at on-demand prices).
    on_demand: Literal["never", "deadline", "hold_size"] = "deadline"
    # hold_size: how long to wait for spot before falling back to on-demand.
    spot_wait_s: Annotated[float, Field(ge=0)] = 600.0
    capacity_error_ttl_s: Annotated[float, Field(gt=0)] = 600.0
    # Before paying for on-demand, a spot pool whose capacity error is at least this old is tried
    # again (one CreateFleet; a failure costs a pass, then on-demand). Capped at the TTL. Without
    # it the error's memory buys on-demand while spot may be back (docs/DESIGN.md).
    spot_probe_s: Annotated[float, Field(gt=0)] = 60.0
    max_spot_price_per_hour: PositiveUsd | None = None
    launch_template: str | None = None  # name of an existing template; None: fleetd creates one
    ami_id: str | None = None
    instance_profile_arn: str | None = None
    security_group_ids: tuple[str, ...] = ()
    subnet_ids: tuple[str, ...] = ()
    price_book: Path | None = None  # file price source: demo and simulator only, when set explicitly
    # On-demand prices: the AWS Price List API ("price-list"; the bundled GPU catalog for what it
    # cannot price or when it cannot be reached) or the bundled catalog alone ("catalog").
    on_demand_prices: Literal["price-list", "catalog"] = "price-list"
    price_list_region: str = "us-east-1"  # the Price List API endpoint's region (it serves every region)
    price_refresh_s: Annotated[float, Field(gt=0)] = 86400.0  # list prices change a few times a year
    # Current spot prices (DescribeSpotPriceHistory) are fetched at most this often and reused by
    # the passes in between: spot prices move a few times a day, a pass runs every few seconds.
    spot_price_refresh_s: Annotated[float, Field(gt=0)] = 300.0
    spot_advisor_csv: Path | None = None  # interruption-rate prior (shared/traces snapshot)
    # Placement ranking (fleetd/policy/placement.py): expected USD per useful GPU-hour =
    # price / (GPUs x relative throughput of the GPU model) x (1 + interruptions/node-hour x
    # (interruption_cost_h + the fleet's re-form cost of one interruption)) x (1 + cross_az_penalty
    # for a pool outside the fleet's zone).
    # Node-hours one interruption costs the replaced node itself: the replacement's boot, agent
    # start and checkpoint restore (~10-15 min on a GPU AMI) at the default.
    interruption_cost_h: Annotated[float, Field(ge=0)] = 0.25
    # One synchronous job across AZs pays $0.01/GB each way for every all-reduce byte that crosses
    # (AWS EC2 data transfer within a region) and trains at the inter-AZ link's speed: a pool in
    # another zone than the fleet's counts as (1 + this) times its cost. 1.0: only a pool at least
    # twice as cheap per useful GPU-hour is worth crossing zones for. 0: zones are free to mix.
    cross_az_penalty: Annotated[float, Field(ge=0)] = 1.0
    # Own history counts as much as the Spot Advisor prior after this many node-hours in a pool.
    prior_weight_node_hours: Annotated[float, Field(gt=0)] = 50.0
    # A pool with a notice this recent is "interrupting now" and avoided.
    interrupting_window_s: Annotated[float, Field(ge=0)] = 900.0
    # Notices come in waves: replacements are bought once no new notice came for this long (one
    # CreateFleet for the whole wave), at most notice_coalesce_max_s after the wave's first notice.
    notice_coalesce_s: Annotated[float, Field(ge=0)] = 1.5
    notice_coalesce_max_s: Annotated[float, Field(ge=0)] = 10.0
    # Diversification: at most this many pools per launch, each within this factor of the best.
    max_pools_per_launch: Annotated[int, Field(ge=1)] = 4
    diversify_within: Annotated[float, Field(ge=1)] = 1.5
    # A node that never reports this long after launch is terminated (broken boot).
    boot_timeout_s: Annotated[float, Field(gt=0)] = 900.0

    @model_validator(mode="after")
    def _something_to_buy(self) -> CapacityConfig:
        if not self.instance_types and self.gpu is None:
            raise ValueError("give instance_types or gpu requirements")
        return self


class BudgetConfig(Group):
    total_usd: PositiveUsd = 100.0
    max_usd_per_hour: PositiveUsd = 20.0
    # Graded responses, as fractions of total_usd reached by the forecast (DESIGN.md).
    warn_at: Fraction = 0.8
    forbid_on_demand_at: Fraction = 0.9
    shrink_at: Fraction = 0.95
    # The forecast is spent + current burn over this horizon.
    forecast_horizon_s: Annotated[float, Field(gt=0)] = 3600.0
    # Time a clean stop (coordinated checkpoint, upload, shutdown) may take; kept in reserve.
    stop_reserve_s: Annotated[float, Field(ge=0)] = 180.0

    @model_validator(mode="after")
    def _ordered(self) -> BudgetConfig:
        if not self.warn_at <= self.forbid_on_demand_at <= self.shrink_at:
            raise ValueError("thresholds must satisfy warn_at <= forbid_on_demand_at <= shrink_at")
        return self


class ScalingConfig(Group):
    # Scale up only while one more node adds at least this share of the current average
    # throughput per dollar.
    min_marginal_efficiency: Fraction = 0.7
    scale_up_util_pct: Annotated[float, Field(ge=0, le=100)] = 80.0
    scale_down_util_pct: Annotated[float, Field(ge=0, le=100)] = 30.0
    cooldown_s: Annotated[float, Field(ge=0)] = 300.0
    straggler_ratio: Fraction = 0.5
    # Rates right after a membership change include the re-form pause: judge stragglers only once
    # every node has been in the fleet this long.
    straggler_settle_s: Annotated[float, Field(ge=0)] = 120.0
    # Scale down only when one node's marginal efficiency is below
    # min_marginal_efficiency x (1 - efficiency_hysteresis): no flapping around the threshold.
    efficiency_hysteresis: Annotated[float, Field(ge=0, lt=1)] = 0.1
    initial_nodes: Annotated[int, Field(ge=0)] | None = None  # None: fleet.max_nodes


class RebalanceConfig(Group):
    max_checkpoint_age_s: Annotated[float, Field(gt=0)] = 600.0
    max_recommendation_replacements_per_hour: Annotated[int, Field(ge=0)] = 2
    # A rebalance recommendation with no notice within this window stops counting: the node it
    # pre-bought is released (kept only if it replaces the risky node) and scaling runs again.
    recommendation_expiry_s: Annotated[float, Field(gt=0)] = 1800.0
    silence_s: Annotated[float, Field(gt=0)] = 30.0  # telemetry silence that counts as a signal
    # Do not ask for another checkpoint while the last request is younger than this.
    checkpoint_retry_s: Annotated[float, Field(gt=0)] = 120.0
    # A planned drain (scale-down, return to spot) that has not finished by then is terminated.
    drain_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    # Seconds training pauses for one coordinated checkpoint (delta in Young/Daly). The planner
    # keeps the last durable checkpoint younger than sqrt(2 x delta x MTBF of losses without
    # notice). Default: a few-GB torch DCP save to local disk; set your job's measured save time.
    checkpoint_stall_s: Annotated[float, Field(ge=0)] = 5.0
    # Periodic checkpoints at that Young/Daly interval (fleetd/policy/checkpointing.py). Off by
    # default: fleetd already checkpoints at every join and leave, and with replicated (DDP)
    # state the survivors of a loss without notice save the step they completed
    # (agent/trainer/salvage.py). Worth turning on for sharded state (FSDP/ZeRO), which rolls
    # back instead; bench/sim.py measures both.
    young_daly_checkpoints: bool = False
    # Seconds every rank waits while the rendezvous re-forms after a join or leave (DESIGN.md:
    # 4-6 s measured with fleetd steering). With checkpoint_stall_s it prices a membership
    # change for the on-demand fallback's churn control.
    reform_s: Annotated[float, Field(ge=0)] = 5.0


class FleetdJobConfig(JobConfig):
    """The job as the controller sees it: what the nodes run (JobConfig, shared with the agent)
    and, for a job with a deadline, how much work it is and by when (fleetd/policy/deadline.py)."""

    # The job must be done by then (a UTC date and time, e.g. 2026-12-01T18:00:00Z). With
    # capacity.on_demand = "deadline" (the default), on-demand is bought only when it asks for it.
    deadline: AwareDatetime | None = None
    # The job's total work in training steps (the step the trainer reports when done). Progress
    # is the highest step the nodes report, or the last durable checkpoint's.
    total_steps: Annotated[int, Field(ge=1)] | None = None
    # Seconds from buying a node to it training (boot, agent start, checkpoint restore): d in
    # Can't Be Late (NSDI'24). Default: its larger setting, 0.2 h.
    changeover_s: Annotated[float, Field(ge=0)] = 720.0
    # Expected training steps per second at fleet.max_nodes (from a previous run or a benchmark),
    # used only until fleetd has measured the job's throughput itself. Without it (and without
    # a measurement), the deadline rule knows no work left in seconds: no safety net, only the
    # progress line, so a job whose first nodes are lost before they train can miss its deadline.
    steps_per_s: Annotated[float, Field(gt=0)] | None = None
    # Failures of the job's own code (a non-zero exit no notice, node loss or store outage
    # explains; fleetd/policy/job_state.py) fleetd restarts before the job FAILS and every node
    # is released. 0: the first such failure ends the job.
    max_restarts: Annotated[int, Field(ge=0)] = 3
    # A job file (fleetd/jobs/job_file.py; deploy/examples/job.toml): the job defined there,
    # its workdir packed and shipped to the nodes. Set, it is the job's only definition: the
    # other [job] keys stay unset here.
    file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _name_from_the_file(cls, data: Any) -> Any:
        """Every command that reads this config (status, logs, report) names the job as the job
        file does, not by the default: `fleetd run` alone packs the file, but the name is the
        job's everywhere. An unreadable file is `fleetd run`'s to report, with its reason."""
        if isinstance(data, dict) and data.get("file") and "name" not in data:
            try:
                name = tomllib.loads(Path(data["file"]).read_text(encoding="utf-8")).get("name")
            except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
                name = None
            if isinstance(name, str):
                data = {**data, "name": name}
        return data

    @model_validator(mode="after")
    def _one_definition(self) -> FleetdJobConfig:
        if self.file is not None and not self.code_uri:
            beside = sorted(self.model_fields_set - {"file", "name"})
            if beside:
                raise ValueError(
                    f"with job.file the job is defined in that file only; remove job.{', job.'.join(beside)}"
                )
        return self

    def lifecycle_settings(self) -> JobSettings:
        from fleetd.policy.job_state import JobSettings

        return JobSettings(max_restarts=self.max_restarts, reports_steps=self.checkpoint_dir is None)

    @model_validator(mode="after")
    def _work_with_deadline(self) -> FleetdJobConfig:
        if self.deadline is not None and self.total_steps is None:
            raise ValueError("a job.deadline needs job.total_steps (how much work is due by then)")
        return self

    def deadline_at(self) -> float | None:
        """The deadline on the planner's clock (epoch seconds), or None."""
        return None if self.deadline is None else self.deadline.timestamp()


class StallConfig(Group):
    """Stalled-job detection (fleetd/policy/stall.py): no step this long while nodes are billed."""

    # Longer than any pause a healthy job takes (a re-form, a checkpoint save and upload).
    stall_after_s: Annotated[float, Field(gt=0)] = 180.0
    # Time between recovery actions (restart trainers, re-form, replace the nodes), and the time
    # given to trainers coming back after a rendezvous store restart.
    escalate_after_s: Annotated[float, Field(gt=0)] = 120.0
    # The last rung: terminate the stalled nodes so the planner buys fresh ones.
    replace_nodes: bool = True
    # A node's telemetry older than this does not count as a sign of life.
    telemetry_fresh_s: Annotated[float, Field(gt=0)] = 30.0
    # A rendezvous forming a round (or changed within stall_after_s) is not a stall, for at most
    # this long after the last step (fleetd/policy/stall.py).
    reforming_max_s: Annotated[float, Field(gt=0)] = 600.0

    def settings(self) -> StallSettings:
        from fleetd.policy.stall import StallSettings

        return StallSettings(
            stall_after_s=self.stall_after_s,
            escalate_after_s=self.escalate_after_s,
            replace_nodes=self.replace_nodes,
            telemetry_fresh_s=self.telemetry_fresh_s,
            reforming_max_s=self.reforming_max_s,
        )


class LossConfig(Group):
    """When a node counts as lost, and when a stale store heartbeat forces a re-form
    (docs/DESIGN.md "Partitions"; the measurements behind the defaults are in
    docs/measurements/2026-11-partitions.md)."""

    # No new rendezvous heartbeat for this long is the store's signal in the two-source rule
    # (policy/lifecycle.py); rebalance.silence_s is the broker's.
    store_silence_s: Annotated[float, Field(gt=0)] = 30.0
    # Steering: a member whose store heartbeat is older than dead_after_s is removed (and the
    # survivors re-formed) only once the job has also made no progress for hang_after_s.
    dead_after_s: Annotated[float, Field(gt=0)] = 6.0
    hang_after_s: Annotated[float, Field(gt=0)] = 10.0
    # A member quiet on both the store (no heartbeat) and the broker (no message from its agent,
    # which reports every second) for silent_after_s, while the job made no progress for as long,
    # vanished or froze: it is removed and the survivors re-formed at once. A node cut from one
    # channel, or slowed by load, still speaks on the other and waits out the rule above.
    silent_after_s: Annotated[float, Field(gt=0)] = 2.5


class MetricsConfig(Group):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9464


class EventsConfig(Group):
    sqs_queue_url: str | None = None  # EventBridge -> SQS queue; None disables that intake
    # An event about an instance this fleet does not know (yet) is not deleted at once: it goes
    # back to the queue for unknown_retry_s, until the instance is known (a node launched seconds
    # ago, or any node right after a controller restart) or the event is older than
    # unknown_instance_grace_s (a spot warning is worthless after its two minutes).
    unknown_instance_grace_s: Annotated[float, Field(ge=0)] = 180.0
    unknown_retry_s: Annotated[int, Field(ge=0, le=43200)] = 10


class EnrolConfig(Group):
    """Node certificates (fleetd/identity): agents enrol with their instance identity document."""

    enabled: bool = False
    # The enrolment endpoint (plain HTTP: nothing secret crosses it; agents pin the broker's CA
    # from their own config, never from this answer, when mqtt.ca_file is set).
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 8440
    # The URL nodes enrol at, as they reach it (fleetd's launch template hands it to them). Empty:
    # http://<ha.advertise_host or rendezvous.host>:<port>/v1/enrol.
    public_url: str = ""
    # The fleet CA (`fleetd ca init --dir`): ca.crt/ca.key, the broker's and the controller's certs.
    ca_dir: Path = Path("/etc/fleetd/ca")
    # AWS's published RSA certificate for the region (regions-certs.html), verifying /signature.
    identity_certificate: Path = Path("/etc/fleetd/aws-identity-rsa.pem")
    cert_lifetime_s: Annotated[float, Field(ge=60)] = 3600.0
    # First enrolment only this long after the instance's pendingTime (a replayed document is old).
    max_document_age_s: Annotated[float, Field(gt=0)] = 900.0


class HaConfig(Group):
    """High availability (DESIGN.md, "High availability"): several `fleetd run` on different
    hosts share the state in DynamoDB; the one holding the lease acts, the others stand by."""

    # "sqlite": one control host, state in <state_dir>/fleetd.db (the default). "dynamodb": the
    # state and the ledger in ``table``, leader election by lease, every write fenced.
    backend: Literal["sqlite", "dynamodb"] = "sqlite"
    table: str = "fleetd-state"
    # A standby takes over after the lease went unrenewed this long (by its own clock); the
    # leader renews every lease_s / 3 and stops acting lease_s / 4 before it could expire.
    lease_s: Annotated[float, Field(gt=0)] = 15.0
    # This host's name in the lease (must differ between hosts; empty: the host name).
    host_id: str = ""
    # The address agents reach this host's rendezvous store on; the leader publishes it
    # (retained, fleetd/<fleet>/rendezvous). Empty: the host id.
    advertise_host: str = ""
    # DynamoDB endpoint (None: aws.endpoint_url, else AWS's regional endpoint).
    endpoint_url: str | None = None
    # Create the table when missing (trials, tests). Production creates it from
    # deploy/cloudformation/ha-state.yaml and the controller's IAM has no CreateTable.
    create_table: bool = False


class RegionSettings(Group):
    """A region the job may run in besides [aws] region: what differs there. The job's checkpoints
    (and code) live in a bucket of the region it runs in; an AMI, subnets and security groups are
    regional too (unset: none, as for [capacity]'s own)."""

    region: Annotated[str, Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d+$")]
    bucket: Name
    ami_id: str | None = None
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    instance_profile_arn: str | None = None
    launch_template: str | None = None


class TeamMemberConfig(Group):
    # This job is one of a team's (`fleetd team`, fleetd/team/): before every pass the daemon reads
    # its allotment from <fleet.state_dir>/allotment.json and plans inside it (fleet size, USD/h
    # and total at most the share's; paused: checkpoint, stop, buy nothing). Until the first
    # allotment comes, the job waits.
    member: bool = False
    # Other regions the team may move this job to ([[team.regions]]): when its own runs out of spot
    # capacity and a move pays, the team's loop allots it another; the daemon stops the job with a
    # checkpoint, copies the job's objects to that region's bucket and starts again there
    # (fleetd/team/region_move.py; <fleet.state_dir>/region.json records where it is).
    regions: tuple[RegionSettings, ...] = ()

    @model_validator(mode="after")
    def _one_entry_each(self) -> TeamMemberConfig:
        names = [r.region for r in self.regions]
        if len(names) != len(set(names)):
            raise ValueError("[[team.regions]]: a region is listed twice")
        return self


class FleetdConfig(CommonSettings):
    fleet: FleetConfig = FleetConfig()
    capacity: CapacityConfig = CapacityConfig(instance_types=("g5.xlarge",))
    budget: BudgetConfig = BudgetConfig()
    scaling: ScalingConfig = ScalingConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    loss: LossConfig = LossConfig()
    events: EventsConfig = EventsConfig()
    metrics: MetricsConfig = MetricsConfig()
    job: FleetdJobConfig = FleetdJobConfig()
    stall: StallConfig = StallConfig()
    enrol: EnrolConfig = EnrolConfig()
    ha: HaConfig = HaConfig()
    team: TeamMemberConfig = TeamMemberConfig()


def load(path: Path | None = DEFAULT_PATH) -> FleetdConfig:
    return load_settings(FleetdConfig, path)
