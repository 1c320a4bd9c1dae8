#!/usr/bin/env bash
# Release canary: runs the fast-path tests (-m fast_path: each asserts through fastgen.report() that a
# feature ran, per family) against the newest transformers on the package index, in a throw-away venv.
# A rename upstream (5.24: past_key_values -> cache) then fails here within a day, not at a user's.
#   bash scripts/canary.sh            # newest release
#   bash scripts/canary.sh 5.25.0     # a given one
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-$(python3 -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')}
if [ -z "$version" ]; then
  echo "canary: could not read the newest transformers version from the package index" >&2
  exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "canary: transformers $version in a throw-away venv ($tmp)"
VENV="$tmp/venv" TRANSFORMERS="transformers==$version" bash scripts/setup.sh
"$tmp/venv/bin/python" -m fastgen.info | sed -n 2,3p
"$tmp/venv/bin/python" -m pytest -q -m "fast_path and not slow" -p no:cacheprovider tests
