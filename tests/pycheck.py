"""The Python test scripts' checks: `assert` vanishes under python -O (PYTHONOPTIMIZE), and a test whose
checks vanish passes whatever it runs; check() stays.

Usage, from a script under tests/<dir>/:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pycheck import check  # noqa: E402

A test that cannot run here calls skip(reason): it prints "SKIP: reason" and exits 77 (ctest's
SKIP_RETURN_CODE: the test shows as not run, and `make test` lists it with the reason). Where every test
must run (ZS_NO_SKIP=1, as .ci/run sets) it fails instead.
"""
import os
import sys

SKIP = 77  # ctest: SKIP_RETURN_CODE 77


class CheckFailed(AssertionError):
    """A failed check(): an AssertionError, so it reads (and exits non-zero) as a failed assert did."""


def check(condition, message):
    """Fails the test with `message` (a string, or a callable returning one, evaluated only on failure) when
    condition is false; unlike `assert`, python -O keeps it. A message that is some other object (a tuple of
    the values involved), or a callable returning one, shows as assert's would."""
    if not condition:
        raise CheckFailed(message() if callable(message) else message)


def skip(reason):
    """Ends the test as skipped (exit 77) with `reason` printed, or as failed (exit 1) under ZS_NO_SKIP=1."""
    if os.environ.get("ZS_NO_SKIP") == "1":
        print(f"FAIL: this test would be skipped ({reason}), and ZS_NO_SKIP=1 says this machine must run it",
              flush=True)
        sys.exit(1)
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP)
