#!/usr/bin/env bash
# The ssh backend's tests run real OpenSSH servers (Debian's openssh-server) on loopback addresses, with
# keys made for each run.
set -euo pipefail
if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1; then
  exit 0
fi
exec "$(dirname "$0")/apt_install.sh" openssh-server openssh-client
