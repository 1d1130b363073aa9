# The two entry points of the README. Both do all set-up on a fresh machine first.
.PHONY: test demo setup

setup:
	@scripts/setup.sh

test: setup
	.venv/bin/python -m pytest

demo: setup
	.venv/bin/fleetd demo
