# The README's entry points. Each does all set-up on a fresh machine first.
.PHONY: setup lint test test-fast test-deploy test-explore demo

setup:
	@scripts/setup.sh

# The gates CI runs before the tests: ruff (pyflakes, bugbear, pyupgrade, import order), ruff's
# formatter, mypy --strict over fleetd/ and agent/, the import-linter layer contracts, and vulture
# (dead code; tools/vulture_whitelist.py lists what it may report and why).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/lint-imports --no-cache
	.venv/bin/vulture fleetd agent tools/vulture_whitelist.py --min-confidence 80

# The whole suite, every test, spread over pytest-xdist workers, with the gates (`make lint`) beside
# it (scripts/test_with_gates.sh: their output and status come after the tests'); prints its 15
# slowest tests at the end. Three workers: the demo stacks play one after another in two lanes
# (tests/harness/lanes.py), each on a worker of its own, and the rest fills in around them. A fresh
# clone on the idle 2-core box (2026-11-29): 1,287-1,427 s with three workers as the box's own
# speed moved, ~1,630 s with two (the one lane was the wall). TEST_WORKERS=N deals the stacks to
# N - 1 lanes (one lane for N = 2); TEST_WORKERS=0 runs serially; TEST_LANES=L caps the lanes
# (four workers and two lanes: 1,380 s, three 1,427 s the same day;
# docs/measurements/2026-11-test-suite.md).
TEST_WORKERS ?= 3
test: setup
	scripts/test_with_gates.sh $(TEST_WORKERS)

# The production path under real systemd: the node image built by deploy/image/provision.sh in a
# Debian 12 tree and booted with systemd-nspawn (also part of `make test`).
test-deploy: setup
	.venv/bin/python -m pytest tests/test_deploy_image.py tests/test_deploy_flow.py tests/test_deploy_broker_stock.py tests/test_doctor.py -p no:randomly

# The loop to run while working: every test not marked slow (pure policy, components against moto
# and mosquitto), under 3 minutes on 2 cores. Four workers: many of these tests wait on moto,
# mosquitto or a subprocess, and the extra workers fill that time (2026-11-27, idle 2-core box,
# 1,178 tests: 217 s with two workers, 174-180 s with three, 161 s with four). At 1,346 tests it
# had grown to 196-198 s; the two 20-CPU-s experiments (2,000 budget runs, the 200-offset deadline
# sweep) moved to the full suite, and the working loop draws 200 budget runs: 1,344 tests, 153 s;
# 1,348 tests, 166 s (2026-11-29); later that day 159-222 s as the box's own speed moved (a fixed
# Python loop took 1.3-2.5 CPU-s; docs/measurements/2026-11-test-suite.md).
test-fast: setup
	.venv/bin/python -m pytest -m "not slow" -n 4 --durations=10

# Long property runs on request: the hypothesis tests with fresh random examples (1,000 per
# property) instead of CI's fixed, derandomized draw (tests/conftest.py, the "ci" profile).
test-explore: setup
	HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest -n 2 -p no:cacheprovider $$(grep -l "from hypothesis" tests/test_*.py)

demo: setup
	.venv/bin/fleetd demo
