"""The one exception type users see: a one-line message naming the problem."""


class SpecPilotError(Exception):
    """Bad input or an unavailable resource; the CLIs print it as one line and exit non-zero."""
