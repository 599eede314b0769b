#!/usr/bin/env bash
# Install what `python launch.py --local --containers` and its tests need on Debian/Ubuntu: podman
# with runc (crun refuses hybrid cgroups), netavark and aardvark-dns (containers reach each other
# by name; netavark sets their networks up with iptables, which a slim machine may lack) and
# mmdebstrap (the stand-in base images are made from Debian packages). Needs root.
#   bash scripts/install-containers.sh
set -euo pipefail
packages=(podman runc uidmap mmdebstrap netavark aardvark-dns iptables)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "run as root (or with sudo): apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "container engine ready: $(podman --version)"
