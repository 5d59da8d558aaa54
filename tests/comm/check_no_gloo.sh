#!/usr/bin/env bash
# Fails if a binary we link carries a copy of Gloo or links a Gloo library.
#
# LibTorch 2.x wheels link Gloo statically into libtorch_cpu.so and export its
# symbols; a second Gloo in the same process (Debian's libgloo, or a static copy)
# would resolve some of libtorch's calls to another version's code. zeroshard's
# transport is its own (src/comm/tcp_mesh.cpp), so no binary of ours may define
# a gloo:: symbol or need a libgloo.
# Usage: check_no_gloo.sh BINARY...
set -uo pipefail
status=0
for bin in "$@"; do
  [ -f "$bin" ] || { echo "check_no_gloo: $bin does not exist"; status=1; continue; }
  # nm's own failure, or a stripped binary (no symbols to look through), is a failure
  # of the check, not a pass.
  if ! symbols=$(nm -C --defined-only "$bin" 2>&1); then
    echo "check_no_gloo: nm failed on $bin: ${symbols:0:300}"
    status=1
    continue
  fi
  if [ "$(printf '%s\n' "$symbols" | grep -c ' [TtWw] ')" -lt 100 ]; then
    echo "check_no_gloo: $bin has almost no symbols (stripped?): nothing to check, which proves nothing"
    status=1
    continue
  fi
  defined=$(printf '%s\n' "$symbols" | grep -c " gloo::" || true)
  if [ "$defined" -ne 0 ]; then
    echo "check_no_gloo: $bin defines $defined gloo:: symbols, e.g.:"
    printf '%s\n' "$symbols" | grep " gloo::" | head -3
    status=1
  fi
  if ! dynamic=$(readelf -d "$bin" 2>&1); then
    echo "check_no_gloo: readelf failed on $bin: ${dynamic:0:300}"
    status=1
    continue
  fi
  if grep -q "NEEDED.*libgloo" <<<"$dynamic"; then
    echo "check_no_gloo: $bin links $(grep -o 'libgloo[^]]*' <<<"$dynamic")"
    status=1
  fi
done
[ $status -eq 0 ] && echo "check_no_gloo: $# binaries, no Gloo symbols defined and no libgloo linked"
exit $status
