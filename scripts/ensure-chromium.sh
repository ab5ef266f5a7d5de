#!/usr/bin/env bash
# Make sure headless Chromium (Debian's package) is installed, for the HTML report's browser test.
# Idempotent and quiet: does nothing when chromium is already on PATH; otherwise apt-get installs it
# (needs root, as CI and the developers' machines are). Prints the browser's path on success.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-chromium: chromium is missing and installing it needs root (apt-get install chromium)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # debconf complains on stderr that apt-utils is missing: harmless, filtered; real errors still show
  apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core 2>&1 >/dev/null | { grep -v "^debconf:" >&2 || true; }
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
fi
command -v chromium
