#!/usr/bin/env bash
# Install the system programs the integration and browser tests start: redis-server, nginx, chromium, chromedriver,
# plus a small CJK font so the browser test's screenshot shows the Chinese text and voice names, and podman, runc and
# mmdebstrap for the container image test (tests/test_image.py: it uses a docker daemon instead when one answers).
# Idempotent and quiet: does nothing when everything is already installed.
# SKIP_SYSTEM_DEPS=1 (for hosts without root or sudo): install nothing, only say what is missing; then run pytest with
# -m "not integration and not browser", or install these programs another way.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
[ -f /usr/share/fonts/truetype/wqy/wqy-microhei.ttc ] || need+=(fonts-wqy-microhei)
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || need+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)

if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi

if [ -n "${SKIP_SYSTEM_DEPS:-}" ] && [ "${SKIP_SYSTEM_DEPS}" != 0 ]; then
    echo "install_test_deps: SKIP_SYSTEM_DEPS is set, not installing: ${need[*]}" >&2
    echo "install_test_deps: tests marked integration or browser need them (pytest -m \"not integration and not browser\" leaves them out)" >&2
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_test_deps: need root (or sudo) to install: ${need[*]}" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_test_deps: installing ${need[*]}" >&2
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "install_test_deps: apt-get failed" >&2
    exit 1
fi
# The Debian packages start their services on install where an init system exists; the tests start
# their own instances on free loopback ports, so a system-wide one is neither needed nor used.
