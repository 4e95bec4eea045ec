"""Errors a user can act on: the CLI prints them as one line and exits 2."""


class AttngeomError(Exception):
    """Bad input or an unusable store; the message says what to change."""
