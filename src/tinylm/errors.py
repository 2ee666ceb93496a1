"""The one exception type that means "the user asked for something that cannot be done".

Library code raises `TinyLMError` with a message that names the problem and the fix; the CLI
catches it, prints that single line to stderr and exits with status 2, with no traceback.
Anything else that escapes is a bug in tinylm and keeps its traceback.
"""


class TinyLMError(Exception):
    """A user-facing error: bad input, a missing file, an impossible configuration."""


class Stopped(KeyboardInterrupt):
    """A stop asked for by a signal (SIGTERM, or a second Ctrl-C while training stops cleanly): like Ctrl-C,
    it unwinds through every ``finally`` (locks released, temporary files removed) to the CLI, which
    exits with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
