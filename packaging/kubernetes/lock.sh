#!/usr/bin/env bash
# Refresh packaging/kubernetes/requirements.lock, the image's dependencies: preemptd[kubernetes] and its build
# backend (pyproject.toml's build-system.requires), every package at an exact version with the sha256 of
# every file PyPI has for it (so the same lock installs on linux/amd64 and linux/arm64), resolved for
# Python 3.11, the image's (Debian bookworm's). Run it after changing a dependency in pyproject.toml, or to
# take newer releases; then rebuild the image (build-image.sh) and run its test
# (tests/deploy/test_kubernetes_image.py).
#
#   packaging/kubernetes/lock.sh            # PYTHON=python3.11 by default; INDEX_URL=https://pypi.org/simple
#
# pip-tools runs in a throwaway environment, at the version pinned below. The pip configuration's extra
# indexes and find-links are ignored (PIP_CONFIG_FILE=/dev/null), so that every hash comes from INDEX_URL;
# PIP_CERT (a proxy's CA) still applies.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3.11}"
INDEX_URL="${INDEX_URL:-https://pypi.org/simple}"
PIP_TOOLS="pip-tools==7.7.0"
LOCK=packaging/kubernetes/requirements.lock

command -v "$PYTHON" >/dev/null || { echo "lock.sh: no $PYTHON (the image runs Python 3.11): set PYTHON" >&2; exit 1; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { echo "lock.sh: $PYTHON is not Python 3.11, the image's: set PYTHON" >&2; exit 1; }
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"$PYTHON" -m venv "$tools"
"$tools/bin/python" -m pip install -q --disable-pip-version-check "$PIP_TOOLS"
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    CUSTOM_COMPILE_COMMAND="packaging/kubernetes/lock.sh" \
    "$tools/bin/pip-compile" --quiet --no-config --upgrade \
    --extra kubernetes --all-build-deps --allow-unsafe --strip-extras \
    --generate-hashes --index-url "$INDEX_URL" --no-emit-index-url --no-emit-find-links \
    --output-file "$LOCK" pyproject.toml
echo "lock.sh: wrote $LOCK ($(grep -c '^[a-z]' "$LOCK") packages)"
