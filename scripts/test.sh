#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs what CI runs: ruff, the nvcc compile check, the strict docs
# build, the wheel smoke test (scripts/smoke_wheel.sh: sdist + wheel, installed into a fresh venv), and a version
# matrix: the whole CPU suite on the newest transformers (a fresh .venv resolves the newest release), the
# fast-path tests on the previous minor release, the skip check on the oldest supported one. Each stage prints
# the time it started.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "== $(date -u +%H:%M:%S) $*"; }
stage setup
bash scripts/setup.sh
# Ray Serve, for the deployment's test (tests/serve/test_ray_serve.py), in this environment only: the range
# of pyproject.toml's `ray` extra (about 20 s to install; the other environments skip that test).
.venv/bin/python -m pip install -q "ray[serve]>=2.60,<3"
stage checks
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/check_nvcc.sh
# The documentation site: broken links, missing pages and unknown generated blocks fail (works offline);
# then every internal link and anchor of the built site, and no page speaks of how the work was organised.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "${FASTGEN_SITE_DIR:-site}"
.venv/bin/python scripts/check_docs.py "${FASTGEN_SITE_DIR:-site}" README.md CHANGELOG.md
stage wheel
bash scripts/smoke_wheel.sh
# Triton kernels run under the interpreter on CPU (tests/conftest.py); slow tests stay out of CI. The log ends
# with the 25 slowest tests (setup and teardown included), so a test that grows shows up there.
stage tests
.venv/bin/python -m pytest -q -m "not slow" --durations=25 "$@"
# The older releases run over .venv's packages (scripts/overlay_env.py: that transformers, and any pin it needs,
# first on PYTHONPATH; every requirement checked), or in a venv of their own where that cannot be made consistent.
older() {  # older FOLDER SPEC PYTEST_ARGS...: pytest on transformers SPEC
  local folder=$1 spec=$2
  shift 2
  stage "tests on $spec"
  if .venv/bin/python scripts/overlay_env.py "$folder-overlay" "$spec"; then
    PYTHONPATH="$folder-overlay" .venv/bin/python -m pytest "$@"
  else
    VENV=$folder TRANSFORMERS=$spec bash scripts/setup.sh
    "$folder/bin/python" -m pytest "$@"
  fi
}
# Previous minor release: every fast path must still run there (-m fast_path asserts it through report()).
older .venv-previous "transformers==${FASTGEN_PREVIOUS_TRANSFORMERS:-5.24.0}" -q -m "fast_path and not slow" \
  -p no:cacheprovider "$@"
# Oldest supported transformers: patches outside their tested range must skip and leave upstream intact.
older .venv-oldest "transformers==5.15.1" -q -m "not slow" -p no:cacheprovider tests/test_harness.py tests/models \
  tests/optimizer "$@"
stage done
