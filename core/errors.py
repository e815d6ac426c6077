"""The one exception type a user can cause; the CLI turns it into one line and exit 2."""


class BlockforgeError(Exception):
    """An error caused by user input (bad spec, bad file, wrong shape, missing tool).

    The message is shown to the user as is, so it must say what is wrong and,
    where possible, what to do about it.
    """

    exit_code = 2


def error_line(e: BaseException, *, last: bool = False, limit: int = 300) -> str:
    """One line of an exception's message for a user-facing error.

    ONNX and ONNX Runtime put the cause first; TVM puts its traceback first and the
    cause last (last=True). Falls back to the exception's type name.
    """
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return (lines[-1] if last else lines[0])[:limit]
