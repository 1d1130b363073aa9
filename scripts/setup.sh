#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: mosquitto (apt), a virtualenv, the CPU build of torch,
# then fleetd with its test and demo extras. Called by `make test` and `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# Partition tests cut nodes' connections with iptables in a private network namespace
# (tests/harness/netfault.py): iptables, and ip (iproute2) to bring the namespace's loopback up.
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || need_apt+=(iptables)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || need_apt+=(iproute2)
# Deploy-in-a-box tests (tests/test_deploy_image.py): a Debian 12 tree made by mmdebstrap, booted
# by systemd-nspawn; shellcheck reads the scripts /bin/sh and bash run on the hosts.
command -v mmdebstrap >/dev/null 2>&1 || need_apt+=(mmdebstrap)
command -v systemd-nspawn >/dev/null 2>&1 || need_apt+=(systemd-container)
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt-get"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi

# Packages go in with uv where it can be had: seconds where pip takes minutes (the same 148
# packages: 13 s against 358 s on the loaded 2-core box, docs/measurements/2026-11-test-suite.md),
# else with pip. uv reads no pip configuration, so pip's local wheel folders (find-links, where a
# CPU build of torch may lie) and PIP_EXTRA_INDEX_URL are passed on to it.
UV_VERSION=0.13.9
install() {
  if [ -x .venv/bin/uv ] || .venv/bin/pip install -q "uv==$UV_VERSION" >/dev/null 2>&1; then
    local links uv_args=()
    links="${PIP_FIND_LINKS:-$(.venv/bin/pip config get global.find-links 2>/dev/null || true)}"
    for dir in $links; do uv_args+=(--find-links "$dir"); done
    if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
      uv_args+=(--extra-index-url "$PIP_EXTRA_INDEX_URL" --index-strategy unsafe-best-match)
    fi
    # copy: the cache and the checkout are often on different filesystems (no hard links there).
    UV_LINK_MODE=copy .venv/bin/uv pip install -q --python .venv/bin/python "${uv_args[@]}" "$@"
  else
    echo "setup: uv unavailable, installing with pip"
    .venv/bin/pip install -q "$@"
  fi
}

# torch first, pinned to a CPU build: an unpinned torch drags in several GB of CUDA wheels.
# (Where no local CPU wheel exists, point PIP_EXTRA_INDEX_URL at a CPU wheel index.)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch (CPU build)"
  install "torch==${TORCH_VERSION:-2.13.0}"
fi

stamp=.venv/.fleetd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "setup: installing fleetd[test,demo,lint]"
  # The test extra brings transformers, accelerate and lightning (the framework callbacks' tests):
  # pin the torch installed above so none of them swaps the CPU build for another one.
  .venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-constraint.txt
  # constraints.txt: the exact versions the suite was last run green with (CI installs the same).
  install -c .venv/torch-constraint.txt -c constraints.txt -e '.[test,demo,lint]'
  touch "$stamp"
fi

# Bytecode, compiled once here. uv installs none, and a process started with
# PYTHONDONTWRITEBYTECODE (set on some CI and sandbox images) writes none either: every torchrun,
# worker, warm pool and agent then compiled torch, botocore and pydantic from source at each start.
# That cost the demo 25 % of its CPU and ~0.7 s per join pause (a fresh clone, 2026-11-28:
# docs/measurements/2026-11-rendezvous.md; the suite: 2026-11-test-suite.md). Reading bytecode needs no write access at run time.
bytecode_stamp=.venv/.fleetd-bytecode
if [ ! -f "$bytecode_stamp" ] || [ "$stamp" -nt "$bytecode_stamp" ]; then
  echo "setup: compiling the installed packages' bytecode"
  # A few packages ship files that do not compile (templates, Python 2 test data): not an error.
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  touch "$bytecode_stamp"
fi
# fleetd's own code changes with every checkout: compileall rewrites only what is out of date.
.venv/bin/python -m compileall -q -j 0 fleetd agent >/dev/null
