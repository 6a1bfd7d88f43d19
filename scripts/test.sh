#!/usr/bin/env bash
# Sets up .venv (pinned) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The UI test drives a real headless Chromium.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "scripts/test.sh: the UI test needs chromium (Debian: apt-get install chromium)" >&2
  fi
fi
# The board's tests on Postgres start their own throwaway server (tests/conftest.py) from Debian's binaries.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "scripts/test.sh: the board's Postgres tests need PostgreSQL (Debian: apt-get install postgresql)" >&2
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
# One worker per core, each test file on one worker (its module fixtures built once); POLYINF_TEST_WORKERS=0
# runs in this process.
exec .venv/bin/python -m pytest -n "${POLYINF_TEST_WORKERS:-$(nproc)}" --dist loadfile "$@"
