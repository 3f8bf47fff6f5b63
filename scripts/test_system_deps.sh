#!/usr/bin/env bash
# System packages the test suite needs beyond the venv: the multi-node tests (tests/test_multinode.py) bring up
# 2 network namespaces with an sshd each and launch over pdsh. Installs what is missing when run as root
# (as CI does); otherwise says what is missing (those tests then skip with the reason). Never fails the caller.
missing=$(for pkg in iproute2 openssh-server openssh-client pdsh; do dpkg -s "$pkg" >/dev/null 2>&1 || echo "$pkg"; done)
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing) >/dev/null \
    || echo "could not install:" $missing >&2
else
  echo "not installed (the multi-node tests will skip):" $missing >&2
fi
exit 0
