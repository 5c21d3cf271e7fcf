#!/usr/bin/env bash
# The browser test drives Debian's Chromium with Playwright (never a downloaded browser).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
exec "$(dirname "$0")/apt_install.sh" chromium
