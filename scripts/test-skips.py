#!/usr/bin/env python3
"""After `make test`: one line for each test that did not run, and why.

    scripts/test-skips.py BUILD_DIR/ctest-junit.xml

Two kinds: a ctest test that exited with its SKIP_RETURN_CODE (the reason is the "SKIP: ..." line it printed),
and a GoogleTest case inside a test that ran, skipped by GTEST_SKIP (the reason is the message gtest printed
before "[  SKIPPED ]"; a case run by several ranks is listed once). Exits 1 when a ctest test did not run and
ZS_NO_SKIP=1 (.ci/run: a machine that must run every test), else 0.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

RANK = re.compile(r"^\[rank\d+\]: ")
GTEST_SKIPPED = re.compile(r"^\[  SKIPPED \] (\S+\.\S+)(?: \(\d+ ms\))?$")


def reason_of_skip(output, fallback):
    for line in output.splitlines():
        line = RANK.sub("", line).strip()
        if line.startswith("SKIP:"):
            return line[len("SKIP:"):].strip()
    return fallback


def gtest_skips(output):
    """{case: reason} for each GTEST_SKIP in the output (gtest prints 'file:line: Skipped', the message, then
    '[  SKIPPED ] Case.Name (N ms)'). Ranks' lines interleave: the message is read from the lines of the rank
    that printed the case."""
    lines = output.splitlines()
    found = {}
    for i, raw in enumerate(lines):
        rank = RANK.match(raw)
        prefix = rank.group(0) if rank else ""
        m = GTEST_SKIPPED.match(raw[len(prefix):].rstrip())
        if not m or m.group(1) in found:
            continue
        mine = [l[len(prefix):].rstrip() for l in lines[max(0, i - 40):i] if RANK.match(l) == rank or
                (rank and l.startswith(prefix))]
        reason = ""
        for j in range(len(mine) - 1, -1, -1):  # the message sits between "Skipped" and this line
            if mine[j].endswith(": Skipped"):
                reason = " ".join(l.strip() for l in mine[j + 1:] if l.strip() and not l.startswith("["))
                break
        found[m.group(1)] = reason or "no reason given"
    return found


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: test-skips.py CTEST_JUNIT_XML")
    path = sys.argv[1]
    if not os.path.exists(path):
        print(f"test-skips: no {path} (ctest did not write its report); cannot list the tests that did not run")
        return 1 if os.environ.get("ZS_NO_SKIP") == "1" else 0
    not_run, cases = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        out = case.findtext("system-out") or ""
        if case.get("status") == "notrun":
            skipped = case.find("skipped")
            not_run.append((name, reason_of_skip(out, skipped.get("message", "") if skipped is not None else "")))
        else:
            cases += [(name, c, why) for c, why in gtest_skips(out).items()]
    if not not_run and not cases:
        print("---- every test ran (none skipped) ----")
        return 0
    print(f"---- {len(not_run)} test(s) and {len(cases)} GoogleTest case(s) did not run ----")
    for name, why in not_run:
        print(f"not run: {name}: {why}")
    for name, case, why in cases:
        print(f"skipped in {name}: {case}: {why}")
    if not_run and os.environ.get("ZS_NO_SKIP") == "1":
        print(f"FAIL: ZS_NO_SKIP=1 and {len(not_run)} test(s) did not run: {', '.join(n for n, _ in not_run)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
