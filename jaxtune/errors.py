"""The one exception type a user sees: a message that names the file, key or value at fault.

The CLI prints it as a single line (no traceback) and exits non-zero; notebooks get a normal exception.
"""


class JaxtuneError(Exception):
    """A problem with the user's input (files, configs, shapes), explained in one line."""
