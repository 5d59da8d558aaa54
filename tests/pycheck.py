"""The Python test scripts' checks: `assert` vanishes under python -O (PYTHONOPTIMIZE), and a test whose
checks vanish passes whatever it runs; check() stays.

Usage, from a script under tests/<dir>/:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pycheck import check  # noqa: E402
"""


class CheckFailed(AssertionError):
    """A failed check(): an AssertionError, so it reads (and exits non-zero) as a failed assert did."""


def check(condition, message):
    """Fails the test with `message` (a string, or a callable returning one, evaluated only on failure) when
    condition is false; unlike `assert`, python -O keeps it. A message that is some other object (a tuple of
    the values involved), or a callable returning one, shows as assert's would."""
    if not condition:
        raise CheckFailed(message() if callable(message) else message)
