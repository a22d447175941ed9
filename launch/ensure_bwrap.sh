#!/usr/bin/env bash
# Make bubblewrap (the local sandbox runtime) available: nothing when `bwrap` is on PATH, an apt install as
# root, else exit 1 with a line saying why (the caller decides what to do without it).
set -euo pipefail
command -v bwrap >/dev/null && exit 0
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  command -v bwrap >/dev/null && exit 0
fi
echo "bubblewrap is missing and cannot be installed here (needs root and apt-get): install the 'bubblewrap'" \
     "package, or run the sandbox with sandbox.runtime=process sandbox.allow_unisolated=true (NO isolation)" >&2
exit 1
