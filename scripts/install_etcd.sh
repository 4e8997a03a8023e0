#!/usr/bin/env bash
# Install the etcd server (for the etcd discovery tests and `kvwire up --discovery etcd`) when it is
# missing: Debian/Ubuntu package etcd-server (etcd 3.4+). Exits 0 when etcd is on PATH afterwards,
# 1 (with a message) where it cannot be installed (no apt-get, not root and no sudo).
set -uo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_etcd: no apt-get here; install etcd (>= 3.4) yourself to run the etcd tests" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install_etcd: not root and no passwordless sudo; run: apt-get install etcd-server" >&2
    exit 1
  fi
fi
echo "install_etcd: apt-get install etcd-server" >&2
# The package's own service is not needed (tests start etcd on free loopback ports): policy-rc.d
# keeps the post-install script from starting it on hosts that run an init system.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod +x "$policy" && created_policy=1
fi
$SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
rc=$?
if [ "$created_policy" = 1 ]; then
  $SUDO rm -f "$policy"
fi
if [ $rc -ne 0 ] || ! command -v etcd >/dev/null 2>&1; then
  echo "install_etcd: apt-get install etcd-server failed (rc=$rc); the etcd tests will be skipped" >&2
  exit 1
fi
