"""The one exception type for bad user input: the CLI prints its message on one line and exits."""


class UserError(Exception):
    """Something the user can fix; the message says what is wrong and what to do."""


class Fault(Exception):
    """A fault of ours found at run time (e.g. speculative output diverging from plain output):
    printed as one line like a UserError, but exit code 1, and worth a bug report."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP (what `timeout` and service managers send): unwinds like Ctrl-C, so
    that temporary files and directories are removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
