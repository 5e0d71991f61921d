"""The one exception type the CLI turns into a single line on stderr and exit status 2."""


class InputError(ValueError):
    """A user-supplied value is invalid. The message names the value and what would be valid."""
