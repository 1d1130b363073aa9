#!/bin/bash
# Issue 14's must-show: `fleetd demo --scenario calm` with the `fleetd rendezvous` process SIGKILLed
# from outside ~60 s after training starts, as a user (or the OOM killer) would.
#   scripts/demo_kill_store.sh WORKDIR REPORT.json
# Prints the kill's pid and step, the demo's exit status, and any process left behind.
set -u
W=$1; R=$2
rm -rf "$W"; mkdir -p "$W"
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD
nice .venv/bin/python -m fleetd.cli demo --scenario calm --workdir "$W" --report "$R" > "$W/demo.out" 2>&1 &
DEMO=$!
until grep -q '"ev": *"step"' "$W/trainer-events.jsonl" 2>/dev/null; do sleep 1; kill -0 $DEMO 2>/dev/null || exit 1; done
echo "training started $(date +%s.%N)"
sleep 60
PID=$(pgrep -f -- "fleetd.cli rendezvous --config $W/fleetd.toml" | head -1)
STEP=$(grep -o '"step": *[0-9]*' "$W/trainer-events.jsonl" | tail -1)
echo "killing rendezvous pid $PID at $(date +%s.%N), last $STEP"
kill -9 "$PID"
wait $DEMO; echo "demo exit $?"
echo "left behind:"; pgrep -af -- "$W" | grep -v demo_kill_store || echo none
