"""The node image built by the very script Packer runs (deploy/image/provision.sh), in a Debian 12
root filesystem, then booted with systemd as PID 1 (tests/harness/deploy_box.py).

What this box cannot prove, and what covers it instead: Ubuntu's and Amazon Linux's own packages
(the Python guard below, and the polkit grant in both formats: the .rules file polkit >= 0.106
reads is exercised here on Debian's polkit 122, the .pkla one only by its format check); the real
Packer run (its template is parsed and its provisioner must run this file, tests below); IAM
(tests/test_iam_policies.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hcl2
import pytest

from tests.harness.deploy_box import IMAGE_UPLOADS, PROVISION, booted, copy_tree

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UPLOADS = IMAGE_UPLOADS


def _unquote(v: str) -> str:
    return v[1:-1].replace('\\"', '"') if len(v) >= 2 and v[0] == v[-1] == '"' else v


def test_packer_runs_the_provisioning_script_with_bash_not_inline_sh() -> None:
    tpl = hcl2.load((DEPLOY / "packer" / "fleet-agent.pkr.hcl").open())
    (build,) = tpl["build"]
    shells = [p['"shell"'] for p in build["provisioner"] if '"shell"' in p]
    # Inline commands run under /bin/sh -e (dash): nothing there may need bash.
    for shell in shells:
        for line in shell.get("inline", []):
            assert "pipefail" not in line and "[[" not in line, line
    (script,) = [s for s in shells if "script" in s]
    assert _unquote(script["script"]) == "${path.root}/../image/provision.sh"
    assert "sudo" in _unquote(script["execute_command"])
    assert PROVISION.read_text().startswith("#!/usr/bin/env bash\n")
    assert os.access(PROVISION, os.X_OK)
    # Every file the script installs is uploaded, under the name it reads.
    uploaded = set()
    for p in build["provisioner"]:
        if '"file"' in p:
            f = p['"file"']
            dest = _unquote(f["destination"])
            for src in f.get("sources", [f.get("source")]):
                src = _unquote(src)
                uploaded.add(dest.rsplit("/", 1)[1] or Path(src).name)
                if src.startswith("${path.root}"):
                    assert (DEPLOY / "packer" / src.removeprefix("${path.root}/")).resolve().exists(), src
    assert set(UPLOADS) <= uploaded, set(UPLOADS) - uploaded
    variables = {_unquote(k): v for var in tpl["variable"] for k, v in var.items()}
    assert "Ubuntu 24.04" in _unquote(variables["base_ami_name"]["default"])  # Python 3.12


def test_the_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is not installed: scripts/setup.sh installs it"
    out = subprocess.run(
        [shellcheck, str(PROVISION), str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout


def test_an_old_python_stops_the_build_early_with_the_reason(tmp_path: Path) -> None:
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.10.12 ;; *) exit 1 ;; esac\n')
    fake.chmod(0o755)
    (tmp_path / "fleetd-0-py3-none-any.whl").write_text("")
    env = {
        "PATH": os.environ["PATH"],
        "FILES": str(tmp_path),
        "WHEEL": "fleetd-0-py3-none-any.whl",
        "PYTHON": str(fake),
    }
    out = subprocess.run(["bash", str(PROVISION)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1
    assert "is 3.10.12; fleetd needs >= 3.11" in out.stderr and "Ubuntu 24.04" in out.stderr, out.stderr


def test_polkit_grant_in_both_formats_names_the_same_actions() -> None:
    rules = (DEPLOY / "polkit" / "50-fleet-agent-poweroff.rules").read_text()
    pkla = (DEPLOY / "polkit" / "50-fleet-agent-poweroff.pkla").read_text()
    actions = (
        "org.freedesktop.login1.power-off",
        "org.freedesktop.login1.power-off-multiple-sessions",
        "org.freedesktop.login1.power-off-ignore-inhibit",
    )
    for a in actions:
        assert f'"{a}"' in rules
    (line,) = [ln for ln in pkla.splitlines() if ln.startswith("Action=")]
    assert set(line.removeprefix("Action=").split(";")) == set(actions)
    assert "Identity=unix-user:fleet-agent" in pkla and 'subject.user == "fleet-agent"' in rules
    for key in ("ResultAny=yes", "ResultInactive=yes", "ResultActive=yes"):
        assert key in pkla


@pytest.fixture
def image(node_image: Path, tmp_path: Path) -> Path:
    """A copy of the session's image (tests/conftest.py): each test boots and writes its own."""
    root = tmp_path / "root"
    root.mkdir()
    return copy_tree(node_image, root)


@pytest.mark.slow
def test_the_image_has_the_agent_installed_as_the_unit_runs_it(image: Path) -> None:
    venv = image / "opt" / "fleetd" / "venv"
    assert (venv / "bin" / "fleet-agent").exists()
    assert (image / "etc/systemd/system/multi-user.target.wants/fleet-agent.service").is_symlink()
    conf = (image / "etc" / "fleetd" / "agent.toml").stat()
    assert stat.S_IMODE(conf.st_mode) == 0o640 and conf.st_uid == 0
    assert (image / "etc/polkit-1/rules.d/50-fleet-agent-poweroff.rules").exists()
    assert (image / "etc/polkit-1/localauthority/50-local.d/50-fleet-agent-poweroff.pkla").exists()
    # The script cleaned up its uploads.
    assert not list((image / "var" / "tmp" / "fleetd-image").glob("*.whl"))


@pytest.fixture
def fake_imds() -> Iterator[str]:
    """The node's IMDS, on the host (the machine shares the host's network)."""
    from tests.harness.ports import free_port, wait_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.doubles.fake_imds", "--port", str(port), "--instance-id", "i-0dec0ffee0000001"],
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        wait_port("127.0.0.1", port, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_the_booted_image_runs_the_agent_and_lets_it_and_no_one_else_power_off(image: Path, fake_imds: str) -> None:
    # What a launch template's user data writes at boot; the agent.toml baked in is the example's,
    # whose enrolment URL answers nothing here: the agent must be READY anyway (it watches IMDS
    # while it waits for its certificate), or the boot waits for its start timeout.
    env = image / "etc" / "fleetd" / "agent.env"
    env.write_text(f"FLEETD_NODE__IMDS_URL={fake_imds}\n")
    with booted(image, "fleetd-node-image") as node:
        assert node.run("systemctl", "is-enabled", "fleet-agent.service").stdout.strip() == "enabled"
        deadline = time.monotonic() + 60
        while node.run("systemctl", "is-active", "fleet-agent.service", check=False).stdout.strip() != "active":
            assert time.monotonic() < deadline, node.run(
                "journalctl", "-u", "fleet-agent", "--no-pager", check=False
            ).stdout[-3000:]
            time.sleep(0.5)
        journal = node.run("journalctl", "-u", "fleet-agent", "--no-pager", "-o", "cat").stdout
        assert '"agent_started"' in journal and "i-0dec0ffee0000001" in journal
        # The dead man's switch's path: logind's power-off, allowed by polkit for fleet-agent only.
        # pkcheck asks polkitd about a process of that user (a sleeping one, started for it).
        for user, allowed in (("fleet-agent", True), ("nobody", False)):
            pid = node.run("runuser", "-u", user, "--", "sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!").stdout.strip()
            out = node.run("pkcheck", "--action-id", "org.freedesktop.login1.power-off", "--process", pid, check=False)
            assert (out.returncode == 0) is allowed, (user, out.stdout, out.stderr)


def test_what_sh_and_bash_run_at_boot_and_build_passes_shellcheck_as_that_shell(tmp_path: Path) -> None:
    """Packer runs inline commands with /bin/sh -e (dash): they are checked as sh. The user data
    fleetd's launch template carries runs as bash (its shebang): checked as bash."""
    from fleetd.adapters.launch_template import agent_user_data
    from fleetd.config import FleetdConfig

    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is not installed: scripts/setup.sh installs it"
    tpl = hcl2.load((DEPLOY / "packer" / "fleet-agent.pkr.hcl").open())
    (build,) = tpl["build"]
    inline = [line for p in build["provisioner"] if '"shell"' in p for line in p['"shell"'].get("inline", [])]
    assert inline, "the template's inline commands were not found"
    sh = tmp_path / "inline.sh"
    sh.write_text("#!/bin/sh\nset -e\n" + "\n".join(_unquote(line) for line in inline) + "\n")
    user_data = tmp_path / "user-data"
    user_data.write_text(agent_user_data(FleetdConfig()))
    for script, shell in ((sh, "sh"), (user_data, "bash")):
        out = subprocess.run([shellcheck, "-s", shell, str(script)], capture_output=True, text=True)
        assert out.returncode == 0, (shell, out.stdout)
    # And a bash-only line in the inline commands is caught.
    sh.write_text("#!/bin/sh\nset -euo pipefail\n[[ -d /tmp ]] && echo ok\n")
    assert subprocess.run([shellcheck, "-s", "sh", str(sh)], capture_output=True).returncode != 0
