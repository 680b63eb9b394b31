"""The launcher's one error type."""


class LaunchError(ValueError):
    """Bad launch input (hostfile, filters, counts, options, env files): the message names the problem and the fix."""
