#!/usr/bin/env bash
# After a failed `make test`: the lines that say why, for each failed test, at
# the end of the log (ctest prints each test's whole output in run order, so in
# a long log the cause can be far from the summary).
#   scripts/test-failures.sh BUILD_DIR
set -euo pipefail
log="$1/Testing/Temporary/LastTest.log"
failed="$1/Testing/Temporary/LastTestsFailed.log"
[ -f "$log" ] && [ -f "$failed" ] || exit 0
echo "---- why each failed test failed (from $log) ----"
cut -d: -f2- "$failed" | while read -r name; do
  echo "== $name"
  awk -v name="$name" '
    $0 ~ "^[0-9]+/[0-9]+ Testing: " name "$" { inside = 1; next }
    inside && /^<end of output>/ { exit }
    inside' "$log" |
    grep -E -i "failure|FAILED|error|expected|which is|actual|value of|timed out|terminate|what\(\)|signal|killed|abort|exit code|exited|exceed|difference" |
    grep -v -E "^\[rank[0-9]+\]: \[  PASSED|^\[rank[0-9]+\]: \[       OK" | head -n 40 || true
done
