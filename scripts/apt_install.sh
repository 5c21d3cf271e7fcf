#!/usr/bin/env bash
# Install Debian packages for the tests (scripts/ensure_*.sh call it once their own check found them missing),
# when we may: as root, or with passwordless sudo; else say what to install and fail.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "apt_install: $* missing; install it (Debian/Ubuntu: apt-get install $*) and re-run" >&2
  exit 1
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
