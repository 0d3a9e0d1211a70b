"""The one exception type for bad user input: the CLI prints its message on one line and exits."""


class UserError(Exception):
    """Something the user can fix; the message says what is wrong and what to do."""
