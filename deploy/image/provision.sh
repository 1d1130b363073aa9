#!/usr/bin/env bash
# Bakes fleet-agent into a node image. Packer uploads this file with the files it names and runs
# it as root (deploy/packer/fleet-agent.pkr.hcl); tests/test_deploy_image.py runs the very same
# file in a Debian 12 root filesystem under systemd-nspawn. A bash script, not Packer's inline
# list: Packer runs inline commands with /bin/sh -e, and dash rejects `set -o pipefail`.
#
# Inputs (environment):
#   FILES       folder holding the uploaded files (default /tmp/fleetd-image)
#   WHEEL       the fleetd wheel, a path inside FILES or absolute
#   TORCH_SPEC  pip requirement for torch (default: the range pyproject.toml tests)
#   PYTHON      the interpreter to build the venv with (default: python3)
#   PIP_ARGS    extra pip arguments (the image test passes --find-links for an offline build)
set -euo pipefail

FILES=${FILES:-/tmp/fleetd-image}
WHEEL=${WHEEL:?WHEEL must name the fleetd wheel}
TORCH_SPEC=${TORCH_SPEC:-torch>=2.11,<2.14}
PYTHON=${PYTHON:-python3}
PIP_ARGS=${PIP_ARGS:-}
VENV=/opt/fleetd/venv
MIN_PYTHON=3.11  # pyproject.toml requires-python: TaskGroup, asyncio.timeout

log() { printf 'provision: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

case "$WHEEL" in /*) ;; *) WHEEL="$FILES/$WHEEL" ;; esac
[ -f "$WHEEL" ] || die "no wheel at $WHEEL"
[ "$(id -u)" -eq 0 ] || die "run as root (Packer: execute_command with sudo)"

# Fail early and plainly where the base image's Python is too old (Ubuntu 22.04 has 3.10).
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on this image"
if ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN_PYTHON'.split('.'))))"; then
    die "$PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())'); fleetd needs >= $MIN_PYTHON. Use a base image with a newer Python (the default, Ubuntu 24.04, has 3.12) or set PYTHON to one (e.g. python3.11 from the distribution)"
fi

if command -v cloud-init >/dev/null 2>&1; then
    cloud-init status --wait >/dev/null || true  # apt must not race cloud-init's own updates
fi

if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-venv >/dev/null
fi

install -m 0644 "$FILES/fleetd-sysusers.conf" /usr/lib/sysusers.d/fleetd.conf
systemd-sysusers

"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086 # PIP_ARGS is a list of words
"$VENV/bin/pip" install --quiet $PIP_ARGS "$TORCH_SPEC"
# shellcheck disable=SC2086
"$VENV/bin/pip" install --quiet $PIP_ARGS "$WHEEL"

install -d -m 0750 -o root -g fleet-agent /etc/fleetd /etc/fleetd/mqtt
install -m 0640 -o root -g fleet-agent "$FILES/agent.toml" /etc/fleetd/agent.toml
install -m 0644 "$FILES/fleet-agent.service" /etc/systemd/system/fleet-agent.service

# The dead man's switch powers the node off through logind; polkit must let fleet-agent do it.
# polkit >= 0.106 reads JavaScript rules; 0.105 (Ubuntu 22.04, Debian 11) only .pkla files.
install -D -m 0644 "$FILES/50-fleet-agent-poweroff.rules" /etc/polkit-1/rules.d/50-fleet-agent-poweroff.rules
install -D -m 0644 "$FILES/50-fleet-agent-poweroff.pkla" \
    /etc/polkit-1/localauthority/50-local.d/50-fleet-agent-poweroff.pkla

systemd-analyze verify /etc/systemd/system/fleet-agent.service
systemctl daemon-reload 2>/dev/null || true  # no running systemd in a chroot build
systemctl enable fleet-agent.service

"$VENV/bin/fleet-agent" --version
# As the unit runs it: the service user must be able to read what was just installed.
runuser -u fleet-agent -- "$VENV/bin/fleet-agent" config check --config /etc/fleetd/agent.toml >/dev/null

rm -f "$WHEEL" "$FILES"/fleet-agent.service "$FILES"/agent.toml "$FILES"/fleetd-sysusers.conf \
    "$FILES"/50-fleet-agent-poweroff.rules "$FILES"/50-fleet-agent-poweroff.pkla
log "done: $("$VENV/bin/fleet-agent" --version)"
