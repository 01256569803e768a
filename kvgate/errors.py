"""The one error every command turns into exit 2 with a single line."""


class InputError(Exception):
    """Bad input that is not a trace's fault (arguments, targets); exit 2."""
