#!/usr/bin/env bash
# Fails if a binary we link carries a copy of Gloo or links a Gloo library.
#
# LibTorch 2.x wheels link Gloo statically into libtorch_cpu.so and export its
# symbols; a second Gloo in the same process (Debian's libgloo, or a static copy)
# would resolve some of libtorch's calls to another version's code. zeroshard's
# transport is its own (src/comm/tcp_mesh.cpp), so no binary of ours may define
# a gloo:: symbol or need a libgloo.
# Usage: check_no_gloo.sh BINARY...
set -u
status=0
for bin in "$@"; do
  [ -f "$bin" ] || { echo "check_no_gloo: $bin does not exist"; status=1; continue; }
  defined=$(nm -C --defined-only "$bin" 2>/dev/null | grep -c " gloo::")
  if [ "$defined" -ne 0 ]; then
    echo "check_no_gloo: $bin defines $defined gloo:: symbols, e.g.:"
    nm -C --defined-only "$bin" | grep " gloo::" | head -3
    status=1
  fi
  if readelf -d "$bin" | grep -q "NEEDED.*libgloo"; then
    echo "check_no_gloo: $bin links $(readelf -d "$bin" | grep -o 'libgloo[^]]*')"
    status=1
  fi
done
[ $status -eq 0 ] && echo "check_no_gloo: $# binaries, no Gloo symbols defined and no libgloo linked"
exit $status
