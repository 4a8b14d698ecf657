#!/usr/bin/env bash
# Installs, from Debian's packages, the programs the telemetry tests run for real:
#   rsyslogd        (rsyslog)     a private syslog collector on loopback (its own config and port)
#   promtool        (prometheus)  `promtool check metrics` lints the metrics exposition
#   systemd-analyze (systemd)     `systemd-analyze verify` checks deploy/systemd/cryod.service
# Only what is missing is installed. Package scripts must not start the system's rsyslog or
# Prometheus (tests start private instances; the host's logging is not ours to change): when no
# policy-rc.d exists, one that forbids starting services is put in place for the install only.
set -euo pipefail

missing=()
command -v rsyslogd >/dev/null 2>&1 || [ -x /usr/sbin/rsyslogd ] || missing+=(rsyslog)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  echo "install-test-deps.sh: need root to install ${missing[*]}" >&2
  exit 1
fi

policy=/usr/sbin/policy-rc.d
own_policy=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# Temporary, from cryo scripts/install-test-deps.sh: start no service.\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  own_policy=1
fi
cleanup() { if [ -n "$own_policy" ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

echo "install-test-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

for prog in rsyslogd promtool systemd-analyze; do
  if ! command -v "$prog" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$prog" ]; then
    echo "install-test-deps.sh: $prog still missing after the install" >&2
    exit 1
  fi
done
