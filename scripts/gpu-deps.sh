#!/usr/bin/env bash
# Run HERE (a Debian 12 build machine), before scripts/gpu-check.sh is sent to the GPU machine:
# downloads the Debian packages vlmgen builds with (fmt, GoogleTest, nlohmann-json, stb, PCRE2,
# utf8proc, CLI11, pkgconf) into .gpu-deps/ (ignored by git). The GPU machine has
# CUDA, PyTorch, CMake and ninja but no package registry; gpu-check.sh unpacks these files into
# a folder of its own (never into /) and points CMake at it. Pass `.gpu-deps` in the device
# run's `carry`.
#
#   bash scripts/gpu-deps.sh            # then: device run, carry [".gpu-deps"], bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The libraries vlmgen links and their runtime parts, the headers-only ones, and the tools the
# configure step needs (pkgconf for PCRE2/utf8proc).
packages=(libfmt-dev libfmt9 libgtest-dev libgmock-dev nlohmann-json3-dev libstb-dev libstb0
          libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libcli11-dev
          pkgconf-bin libpkgconf3)
rm -rf .gpu-deps
mkdir -p .gpu-deps
# apt-get download writes into the current folder; as root it warns that the _apt user cannot
# write there, which is harmless.
(cd .gpu-deps && apt-get download "${packages[@]}" 2> >(grep -v "unsandboxed" >&2))
count=$(find .gpu-deps -name '*.deb' | wc -l)
if [ "$count" -ne "${#packages[@]}" ]; then
  echo "gpu-deps: expected ${#packages[@]} packages, got $count in .gpu-deps" >&2
  exit 1
fi
echo "gpu-deps: $count packages, $(du -sh .gpu-deps | cut -f1), in .gpu-deps/ (carry it to the GPU machine)"
