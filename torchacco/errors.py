"""The one exception type that reaches the user as a single clear line."""


class UserError(Exception):
    """A mistake the user can fix (config, path, shape, world size).

    The message must say what is wrong, where, and what to do. Entry points print it
    as one line and exit non-zero instead of showing a traceback.
    """
