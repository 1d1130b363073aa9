#!/usr/bin/env bash
# Rewrites constraints.txt from .venv (after `make setup` and a green `make test`). torch is
# pinned by scripts/setup.sh itself (the CPU build), so it is left out here.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The exact versions the test suite ran with (pip freeze of .venv, $(date -u +%F)), used by"
  echo "# scripts/setup.sh as pip constraints so a fresh machine installs what CI tested. Refresh with"
  echo "# scripts/freeze-constraints.sh after changing dependencies, and run make test."
  .venv/bin/pip freeze --exclude-editable | grep -v -e '^torch==' -e '^fleetd' -e '^#'
} > constraints.txt
