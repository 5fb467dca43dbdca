#!/usr/bin/env bash
# Install Prometheus 2.x (server + promtool) from the distribution when either is missing.
# Idempotent; called by `make setup`. meshpilot needs them only for its Prometheus tests and to
# watch runs locally, so where they cannot be installed this prints how and does not fail setup.
#
#   bash deploy/prometheus/install.sh
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
hint="install Prometheus 2.x (prometheus and promtool on PATH: https://prometheus.io/download/)"
if ! command -v apt-get >/dev/null 2>&1; then
    echo "meshpilot setup: prometheus/promtool not found and no apt-get here; $hint" >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo="sudo -n"
    else
        echo "meshpilot setup: prometheus/promtool not found; run: sudo apt-get install -y --no-install-recommends prometheus" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
echo "meshpilot setup: apt-get install -y --no-install-recommends prometheus" >&2
if ! $sudo apt-get install -y -q --no-install-recommends prometheus >/dev/null; then
    $sudo apt-get update -q >/dev/null
    $sudo apt-get install -y -q --no-install-recommends prometheus >/dev/null
fi
# Only the binaries are wanted: do not leave the package's system service listening on :9090.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    $sudo systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null 2>&1 || { echo "meshpilot setup: promtool still missing; $hint" >&2; exit 0; }
