"""One exception type for every user-facing problem.

Messages are one line: what is wrong, then what to do about it. The CLI prints them without a
traceback and exits non-zero; the server returns them as the request's error.
"""


class SpecExportError(ValueError):
    """A problem with the caller's input, paths or models (never an internal bug)."""
