"""The one exception type for bad user input: the CLI prints its message on one line and exits."""


class UserError(Exception):
    """Something the user can fix; the message says what is wrong and what to do."""


class ContextFull(UserError):
    """The prompt or conversation does not fit the model's context (runtime/loop.py's
    check_prompt; start a new conversation, or shorten it)."""


class Fault(Exception):
    """A fault of ours found at run time (e.g. speculative output diverging from plain output):
    printed as one line like a UserError, but exit code 1, and worth a bug report."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP (what `timeout` and service managers send): unwinds like Ctrl-C, so
    that temporary files and directories are removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def require(module: str, extra: str, what: str) -> None:
    """Stop with one line naming the pip extra that provides `module` when it is missing, at
    the start of `what` (e.g. "mtp-export --target onnx") rather than deep inside it."""
    import importlib

    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name != module and not module.startswith(e.name + "."):
            raise UserError(
                f"{module} cannot be imported ({e}): reinstall it with pip install "
                f"'mtp-edge[{extra}]'"
            ) from None
        raise UserError(
            f"{what} needs the {extra} extra: pip install 'mtp-edge[{extra}]'"
        ) from None
    except ImportError as e:
        raise UserError(
            f"{module} cannot be imported ({e}): reinstall it with pip install 'mtp-edge[{extra}]'"
        ) from None
