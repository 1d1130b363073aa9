# The two entry points of the README. Both do all set-up on a fresh machine first.
.PHONY: test demo setup

setup:
	@scripts/setup.sh

# The whole suite, slow tests included, on 2 workers: most end-to-end tests wait on real timeouts,
# not on the CPU. tests/harness/lanes.py plays the longest ones (the demo stacks) in order on one
# worker while the other runs everything else, longest first. TEST_WORKERS=3 splits them into two
# lanes (faster; two demo stacks at once); TEST_WORKERS=0 runs the suite serially in one process.
TEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

demo: setup
	.venv/bin/fleetd demo
