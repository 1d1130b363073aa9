# The two entry points of the README. Both do all set-up on a fresh machine first.
.PHONY: test demo setup

setup:
	@scripts/setup.sh

# The whole suite, slow tests included. TEST_WORKERS=0: serially in one process (the default
# until the parallel runs are shown stable on an idle 2-core box: on a loaded shared one the
# demo tests failed whenever anything ran beside them). TEST_WORKERS=2: the demo stacks played in
# order on one worker, everything else on the other (est. ~22 min on CI instead of ~39);
# TEST_WORKERS=3: the demo stacks in two lanes (est. ~14-16 min). See tests/harness/lanes.py.
TEST_WORKERS ?= 0
test: setup
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

demo: setup
	.venv/bin/fleetd demo
