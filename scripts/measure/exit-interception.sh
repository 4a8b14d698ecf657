#!/usr/bin/env bash
# Builds and runs scripts/measure/exit_interception.c (see its header); prints the kernel and load.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cc -O2 -Wall -pthread -o "$out/xi" "$here/exit_interception.c"
echo "kernel $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
"$out/xi" 2>&1
