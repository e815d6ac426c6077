"""The one exception type a user can cause; the CLI turns it into one line and exit 2."""


class BlockforgeError(Exception):
    """An error caused by user input (bad spec, bad file, wrong shape, missing tool).

    The message is shown to the user as is, so it must say what is wrong and,
    where possible, what to do about it.
    """

    exit_code = 2


class ParityError(BlockforgeError):
    """Outputs disagree beyond tolerance (verify's exit 1)."""

    exit_code = 1
