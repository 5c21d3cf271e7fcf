#!/usr/bin/env bash
# The browser test drives Debian's Chromium with Playwright (never a downloaded
# browser). Install it when it is missing and we may (root, or passwordless sudo).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "ensure_chromium: Chromium is missing; install it (Debian/Ubuntu: apt-get install chromium) and re-run" >&2
  exit 1
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
