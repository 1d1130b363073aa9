#!/usr/bin/env bash
# `make test` after set-up: the lint gates and the whole suite side by side (the gates take ~2 min
# of one core on a fresh clone, which the suite's waits leave free), then the gates' output.
# Fails if either fails. $1: pytest-xdist workers (tests/harness/lanes.py says how they are used).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
workers=${1:-3}
lint_log=$(mktemp)
trap 'rm -f "$lint_log"' EXIT

make --no-print-directory lint-gates >"$lint_log" 2>&1 &
lint_pid=$!
.venv/bin/python -m pytest -n "$workers" --dist loadgroup --no-loadscope-reorder --durations=15
tests=$?
wait "$lint_pid"
lint=$?

echo "---- lint gates (ran beside the tests): exit $lint ----"
cat "$lint_log"
if [ "$lint" -ne 0 ] || [ "$tests" -ne 0 ]; then
  echo "make test: FAILED (lint gates exit $lint, tests exit $tests)" >&2
  exit 1
fi
