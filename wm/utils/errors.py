"""Errors a user can cause, each carrying a single line that names the file or key and what to do.

The CLIs catch `WMError`, print its message as one line and exit non-zero; anything else is a bug
and keeps its traceback.
"""

import argparse


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name if the message is empty): what a
    one-line error quotes of a library's multi-line one."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class WMError(Exception):
    """A failure the user can fix; str(e) is the one line shown to them."""


class ConfigError(WMError):
    """A config key that is unknown, of the wrong type, or refused by its section's validation.

    `key` is the dotted path ("train.lr"); sections raise it with their own field name and the root
    config prefixes the section, so the message always names the full path.
    """

    def __init__(self, key: str, msg: str):
        self.key, self.msg = key, msg
        super().__init__(f"config key '{key}': {msg}")

    def under(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.msg)


class DataError(WMError):
    """A data set, shard or manifest that cannot be used as it is; the message names the file and field."""


class Stopped(BaseException):
    """A stop signal where there is nothing to save (wm.utils.stop_signals): a BaseException, so that no
    `except Exception` swallows it; str(e) is the one line saying what was finished."""

    def __init__(self, signum: int, msg: str):
        self.signum = signum
        super().__init__(msg)


def run_cli(main) -> None:
    """Run a CLI's `main()`: a WMError becomes one line on stderr and exit status 2; a Stopped its
    line and the status of the signal (128 + its number), as if the signal had ended the process."""
    import sys

    try:
        sys.exit(main())
    except WMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


class ArgParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (a WMError: exit 2 through the tool's run_cli), not
    the usage block."""

    def error(self, message):
        raise WMError(f"{message} (see python {self.prog} --help)")
