# The two entry points of the README. Both do all set-up on a fresh machine first.
.PHONY: test demo setup

setup:
	@scripts/setup.sh

# The whole suite, slow tests included, on 3 workers: most end-to-end tests wait on real timeouts,
# not on the CPU, so 3 fit CI's 2 cores. tests/harness/lanes.py keeps the longest ones in two lanes
# (each lane in order on one worker) and hands out the work longest first. TEST_WORKERS=2 leaves
# the CPU more headroom (slower); TEST_WORKERS=0 runs it serially in one process.
TEST_WORKERS ?= 3
test: setup
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

demo: setup
	.venv/bin/fleetd demo
