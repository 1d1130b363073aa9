#!/usr/bin/env bash
# Sets up a control host: fleetd and its rendezvous store under systemd, the broker (mosquitto)
# with the fleet's certificates, the fleet CA readable by the fleetd service user. Run as root on
# Debian 12 or Ubuntu 22.04/24.04; deploy/README.md ("Control host") points here, and
# tests/test_deploy_flow.py runs this very file in a Debian 12 machine under systemd.
#
#   WHEEL=dist/fleetd-0.1.0-py3-none-any.whl BROKER_NAME=broker.fleet.internal \
#   FLEETD_TOML=my-fleetd.toml deploy/control-host/setup.sh
#
# Inputs (environment):
#   WHEEL        the fleetd wheel (python -m build --wheel, or pip wheel --no-deps .)
#   BROKER_NAME  the name (or address) nodes dial the broker by; it goes in the broker's certificate
#   FLEETD_TOML  the controller's config (default: deploy/examples/fleetd.toml, edit it first)
#   TORCH_SPEC   pip requirement for torch (default: the range pyproject.toml tests)
#   PIP_ARGS     extra pip arguments (the test passes --no-index --find-links for an offline install)
#   START        "yes" (default): enable and start the units; "no": install only
#   CA_ARGS      more `fleetd ca init` arguments (HA: --controller-host <each ha.host_id>)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WHEEL=${WHEEL:?WHEEL must name the fleetd wheel}
BROKER_NAME=${BROKER_NAME:?BROKER_NAME must name the broker as nodes reach it}
FLEETD_TOML=${FLEETD_TOML:-$REPO/deploy/examples/fleetd.toml}
TORCH_SPEC=${TORCH_SPEC:-torch>=2.11,<2.14}
PIP_ARGS=${PIP_ARGS:-}
START=${START:-yes}
VENV=/opt/fleetd/venv
CA=/etc/fleetd/ca

log() { printf 'control-host: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root"
[ -f "$WHEEL" ] || die "no wheel at $WHEEL"
[ -f "$FLEETD_TOML" ] || die "no config at $FLEETD_TOML"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "python3 is older than 3.11 (fleetd needs it)"

if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-venv mosquitto >/dev/null
fi

log "service users"
install -m 0644 "$REPO/deploy/sysusers/fleetd.conf" /usr/lib/sysusers.d/fleetd.conf
systemd-sysusers

log "fleetd in $VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC2086 # PIP_ARGS is a list of words
"$VENV/bin/pip" install --quiet $PIP_ARGS "$TORCH_SPEC"
# shellcheck disable=SC2086
"$VENV/bin/pip" install --quiet $PIP_ARGS "$WHEEL"
ln -sf "$VENV/bin/fleetd" /usr/local/bin/fleetd

log "config (/etc/fleetd, readable by group fleetd)"
install -d -m 0750 -o root -g fleetd /etc/fleetd
install -m 0640 -o root -g fleetd "$FLEETD_TOML" /etc/fleetd/fleetd.toml
"$VENV/bin/fleetd" config check --config /etc/fleetd/fleetd.toml

log "fleet CA in $CA (the controller signs node certificates with it)"
# shellcheck disable=SC2086 # CA_ARGS is a list of words (HA: --controller-host ctl-a ...)
"$VENV/bin/fleetd" ca init --dir "$CA" --group fleetd --broker-name "$BROKER_NAME" ${CA_ARGS:-}

log "broker: mosquitto with the fleet's TLS listener and ACL"
install -d -m 0750 -o root -g mosquitto /etc/mosquitto/fleetd
install -m 0644 -o root -g mosquitto "$CA/ca.crt" /etc/mosquitto/fleetd/ca.crt
install -m 0644 -o root -g mosquitto "$CA/server.crt" /etc/mosquitto/fleetd/server.crt
install -m 0640 -o root -g mosquitto "$CA/server.key" /etc/mosquitto/fleetd/server.key
# The ACL fleetd ca init wrote: deploy/mosquitto/acl, plus a block per HA control host identity.
install -m 0644 -o root -g mosquitto "$CA/acl" /etc/mosquitto/fleetd/acl
install -m 0644 "$REPO/deploy/mosquitto/mosquitto.conf" /etc/mosquitto/conf.d/fleetd.conf

log "units"
install -m 0644 "$REPO/systemd/fleetd.service" "$REPO/systemd/fleetd-rendezvous.service" /etc/systemd/system/
systemd-analyze verify /etc/systemd/system/fleetd.service /etc/systemd/system/fleetd-rendezvous.service
if [ "$START" = yes ]; then
    systemctl daemon-reload
    systemctl enable mosquitto
    systemctl restart mosquitto
    systemctl enable --now fleetd-rendezvous fleetd
    log "started; check it with: fleetd doctor --config /etc/fleetd/fleetd.toml"
else
    systemctl enable mosquitto fleetd-rendezvous fleetd
    log "installed and enabled (START=no); they start at the next boot"
fi
