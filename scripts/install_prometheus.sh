#!/usr/bin/env bash
# Debian's prometheus package (the server and promtool), which the monitoring tests run against
# (tests/cluster/test_prometheus.py). Needs apt-get and root; says why and exits 1 otherwise.
set -uo pipefail
command -v promtool >/dev/null && command -v prometheus >/dev/null && exit 0
if ! command -v apt-get >/dev/null; then echo "no apt-get on this machine" >&2; exit 1; fi
if [[ $(id -u) != 0 ]]; then echo "installing prometheus with apt-get needs root" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || { echo "apt-get install prometheus failed" >&2; exit 1; }
