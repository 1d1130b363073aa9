"""deploy/: the example configs, cloud-init user data and the Packer template agree with the code
and with the systemd units (paths, users, directories)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest
import yaml
from pydantic import BaseModel

from agent.config import AgentConfig
from fleetd.adapters.launch_template import AGENT_ENV_FILE
from fleetd.config import FleetdConfig
from fleetd.shared.settings import RendezvousConfig, load_settings
from tests.test_systemd import PROD_BIN, service

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every leaf setting (nested groups expanded)."""
    out = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        ann = info.annotation
        nested = next(
            (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        out += fields(nested, f"{prefix}{key}.") if nested else [f"{prefix}{key}"]
    return out


@pytest.mark.parametrize("cli,path", [("fleetd", "examples/fleetd.toml"), ("fleet-agent", "examples/agent.toml")])
def test_example_configs_pass_config_check(cli, path):
    result = subprocess.run(
        [str(BIN / cli), "config", "check", "--config", str(DEPLOY / path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("model,path", [(FleetdConfig, "examples/fleetd.toml"), (AgentConfig, "examples/agent.toml")])
def test_example_configs_document_every_setting(model, path):
    """Each setting appears, set or commented out, under its [group] (or [group.sub], or an array
    of tables' [[group.sub]])."""
    text = (DEPLOY / path).read_text()
    sections: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        header = re.match(r"^#?\s*\[\[?([a-z_.]+)\]\]?", line)
        if header:
            current = header.group(1)
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key:
            sections.setdefault(current, "")
            sections[current] += f" {key.group(1)} "
    missing = [f for f in fields(model) if f" {f.rsplit('.', 1)[1]} " not in sections.get(f.rsplit(".", 1)[0], "")]
    # Settings only the lead's test/demo harness uses may stay undocumented: none today.
    assert not missing, f"{path} does not document: {missing}"


def test_example_paths_match_the_units():
    fleetd_cfg = load_settings(FleetdConfig, DEPLOY / "examples/fleetd.toml")
    agent_cfg = load_settings(AgentConfig, DEPLOY / "examples/agent.toml")
    assert str(fleetd_cfg.fleet.state_dir) == "/var/lib/" + service("fleetd.service")["StateDirectory"]
    assert str(agent_cfg.node.state_dir) == "/var/lib/" + service("fleet-agent.service")["StateDirectory"]
    assert agent_cfg.node.trainer_socket.parent == Path("/run/" + service("fleet-agent.service")["RuntimeDirectory"])
    assert str(agent_cfg.checkpoints.local_dir).startswith(str(agent_cfg.node.state_dir) + "/")
    assert service("fleet-agent.service")["EnvironmentFile"] == f"-{AGENT_ENV_FILE}"
    # The examples use the names the IAM policies assume.
    node_policy = (DEPLOY / "iam/node-policy.json").read_text()
    assert f"arn:aws:s3:::{agent_cfg.checkpoints.bucket}/{agent_cfg.checkpoints.prefix}/*" in node_policy
    assert (fleetd_cfg.checkpoints.bucket, fleetd_cfg.checkpoints.prefix) == (
        agent_cfg.checkpoints.bucket,
        agent_cfg.checkpoints.prefix,
    )
    assert str(RendezvousConfig().port) in (DEPLOY / "FIREWALL.md").read_text()


def test_sysusers_creates_the_users_the_units_run_as():
    users = {
        line.split()[1] for line in (DEPLOY / "sysusers/fleetd.conf").read_text().splitlines() if line.startswith("u ")
    }
    for unit in ("fleetd.service", "fleetd-rendezvous.service", "fleet-agent.service"):
        assert service(unit)["User"] in users


def test_cloud_init_writes_a_valid_agent_config(tmp_path):
    text = (DEPLOY / "cloud-init/user-data.yaml").read_text()
    assert text.startswith("#cloud-config\n")
    data = yaml.safe_load(text)
    files = {f["path"]: f for f in data["write_files"]}
    agent_toml = files["/etc/fleetd/agent.toml"]
    assert agent_toml["owner"].split(":")[1] == service("fleet-agent.service")["Group"]
    assert agent_toml["permissions"] == "0640"
    path = tmp_path / "agent.toml"
    path.write_text(agent_toml["content"])
    cfg = load_settings(AgentConfig, path)
    # TLS with a pinned broker CA; the node's own certificate comes from enrolment at boot.
    assert cfg.mqtt.tls and cfg.mqtt.ca_file is not None and cfg.node.enrol_url.startswith("http")
    assert ["systemctl", "enable", "fleet-agent.service"] in data["runcmd"]
    assert ["systemctl", "restart", "--no-block", "fleet-agent.service"] in data["runcmd"]


def test_agent_unit_is_not_ordered_after_the_user_data_that_starts_it():
    """User data (cloud-init's runcmd and fleetd's launch-template script) runs inside
    cloud-final.service and (re)starts the agent: ordering the agent after cloud-final deadlocks."""
    from tests.test_systemd import unit

    after = " ".join(unit("fleet-agent.service")["Unit"].get("After", []))
    assert "cloud-final.service" not in after and "cloud-init.service" in after


def _unquote(v):
    """python-hcl2 keeps string literals quoted and escaped: '"a \\"b\\""' -> 'a "b"'."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1].replace('\\"', '"')
    return v


def test_packer_template_bakes_the_agent_into_a_gpu_image():
    tpl = hcl2.load((DEPLOY / "packer/fleet-agent.pkr.hcl").open())
    (source,) = tpl["source"]
    ebs = source['"amazon-ebs"']['"fleet_agent"']
    (ami_filter,) = ebs["source_ami_filter"]
    variables = {_unquote(k): v for var in tpl["variable"] for k, v in var.items()}
    assert "GPU" in _unquote(variables["base_ami_name"]["default"])
    assert ami_filter["filters"]["name"] == "${var.base_ami_name}"
    assert [_unquote(o) for o in ami_filter["owners"]] == ["amazon"]
    assert _unquote(ebs["metadata_options"][0]["http_tokens"]) == "required"

    # The provisioning itself (deploy/image/provision.sh, what the build uploads and runs):
    # tests/test_deploy_image.py, which also runs that script in a booted Debian 12 tree.
    script = (DEPLOY / "image/provision.sh").read_text()
    venv = PROD_BIN.removesuffix("/bin/")
    assert '"$PYTHON" -m venv "$VENV"' in script and f"VENV={venv}" in script
    assert "systemd-sysusers" in script
    assert "systemctl enable fleet-agent.service" in script
    assert "systemd-analyze verify /etc/systemd/system/fleet-agent.service" in script
