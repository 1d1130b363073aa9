#!/usr/bin/env bash
# `make test`: the whole suite with the gates (`make lint`) running beside it. The gates need
# nothing from the tests, so their minute of CPU (mypy, mostly) overlaps the suite's start instead
# of coming before it. Both always run to the end; the gates' output follows the tests', and the
# exit status is the tests' if they failed, else the gates'.
set -uo pipefail
cd "$(dirname "$0")/.."
workers=${1:-2}
gates_log=$(mktemp)
make --no-print-directory lint >"$gates_log" 2>&1 &
gates=$!
# A stopped `make test` (Ctrl-C, a CI timeout) stops the gates too.
trap 'kill "$gates" 2>/dev/null; rm -f "$gates_log"' EXIT
.venv/bin/python -m pytest -n "$workers" --dist loadgroup --no-loadscope-reorder --durations=15
tests_rc=$?
wait "$gates"
gates_rc=$?
echo "---- the gates (make lint), run beside the tests: exit $gates_rc ----"
cat "$gates_log"
if [ "$tests_rc" -ne 0 ]; then
  exit "$tests_rc"
fi
exit "$gates_rc"
