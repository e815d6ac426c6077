"""The one exception type a user can cause; the CLI turns it into one line and exit 2."""


class BlockforgeError(Exception):
    """An error caused by user input (bad spec, bad file, wrong shape, missing tool).

    The message is shown to the user as is, so it must say what is wrong and,
    where possible, what to do about it.
    """

    exit_code = 2


class ArgumentError(BlockforgeError):
    """A user error about arguments of a library call, said in the library's terms. The
    template names each argument as {name}, the API's own name (shape, inputs, tuning_db):
    str() spells them so, and the CLI as its flags (`render(flag_of)`: --shape, --inputs), so
    a library caller never reads about a flag it did not pass. `argument` is the first one
    named (the structured field a caller can branch on)."""

    def __init__(self, template: str, *arguments: str):
        self.template, self.arguments = template, tuple(arguments)
        super().__init__(self.render())

    @property
    def argument(self) -> str:
        return self.arguments[0]

    def render(self, name_of=str) -> str:
        return _render(self.template, self.arguments, name_of)

    def to_dict(self) -> dict:
        return {"template": self.template, "arguments": list(self.arguments)}

    @classmethod
    def from_dict(cls, d: dict) -> "ArgumentError":
        """What an isolation child wrote (to_dict): the error crosses as data, not as text."""
        return cls(str(d["template"]), *map(str, d["arguments"]))


def _render(template: str, arguments: tuple[str, ...], name_of) -> str:
    for a in arguments:
        template = template.replace("{" + a + "}", name_of(a))
    return template


class Phrase(str):
    """A note (not an error) that names arguments as ArgumentError does, {reference}: as a
    str, in JSON and to a library caller it reads with the API's names; the CLI prints
    `render(flag_of)`, its flags."""

    template: str
    arguments: tuple[str, ...]

    def __new__(cls, template: str, *arguments: str) -> "Phrase":
        self = super().__new__(cls, _render(template, arguments, str))
        self.template, self.arguments = template, tuple(arguments)
        return self

    def render(self, name_of=str) -> str:
        return _render(self.template, self.arguments, name_of)


def with_note(e: BlockforgeError, note: str, *arguments: str) -> BlockforgeError:
    """e's message followed by `note` (which may name `arguments` as {name}), keeping e's own
    arguments: one ArgumentError when either names one."""
    if isinstance(e, ArgumentError):
        return ArgumentError(e.template + note, *dict.fromkeys(e.arguments + arguments))
    return ArgumentError(str(e) + note, *arguments) if arguments else BlockforgeError(str(e) + note)


def with_prefix(prefix: str, e: BlockforgeError) -> BlockforgeError:
    """`prefix` (plain text, naming no argument) before e's message, keeping e's arguments."""
    if isinstance(e, ArgumentError):
        return ArgumentError(prefix + e.template, *e.arguments)
    return BlockforgeError(prefix + str(e))


def printable(s, limit: int | None = 200) -> str:
    """A model-controlled string (a tensor, node, op or dim name) as output may show it:
    newlines, ANSI escapes and every other non-printable character escaped as repr() writes
    them, and cut at `limit` characters (None: whole messages), so that a name can neither forge a line (a fake
    "blockforge: error:") nor drive the terminal. Idempotent: backslashes are left as they are."""
    s = str(s)
    if limit is None:
        limit = len(s)
    out = []
    for c in s[:limit]:
        if c.isprintable():
            out.append(c)
        else:
            r = repr(c)[1:-1]  # '\n', '\x1b', '\u202e'
            out.append(r if r.startswith("\\") else f"\\x{ord(c):02x}")
    tail = f"...({len(s)} characters)" if len(s) > limit else ""
    return "".join(out) + tail


def error_line(e: BaseException, *, last: bool = False, limit: int = 300) -> str:
    """One line of an exception's message for a user-facing error.

    ONNX and ONNX Runtime put the cause first; TVM puts its traceback first and the
    cause last (last=True). Falls back to the exception's type name.
    """
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return (lines[-1] if last else lines[0])[:limit]


# ---------------------------------------------------------------- stopping on a signal
#
# The CLI turns SIGINT/SIGTERM into exceptions in the main thread (KeyboardInterrupt,
# Terminated), so every finally block and context manager cleans up. The first signal is
# also remembered here: TVM converts a Python exception raised inside its callbacks into a
# RuntimeError (message lost), and code that catches Exception to carry on (a schedule rule
# that does not apply, a failed candidate) would swallow the request. raise_if_stopped()
# re-raises it at such places; the CLI reads stop_signal() to choose the exit code.


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so cleanup (finally blocks, context managers) runs."""


class _StopState:
    signum: int | None = None  # the first SIGINT/SIGTERM this process received
    deferring: int = 0  # > 0 inside stop_deferred(): the exception waits until the block ends
    pending: bool = False


_STOP = _StopState()


def stop_exception(signum: int) -> BaseException:
    import signal

    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def request_stop(signum: int) -> bool:
    """Record a stop signal (the CLI's handler calls this). True when it should raise now:
    the first signal, outside stop_deferred(). Later signals never raise, so they cannot
    interrupt the cleanup the first one started."""
    if _STOP.signum is not None:
        return False
    _STOP.signum = signum
    if _STOP.deferring:
        _STOP.pending = True
        return False
    return True


def stop_signal() -> int | None:
    return _STOP.signum


def reset_stop() -> None:
    _STOP.signum, _STOP.deferring, _STOP.pending = None, 0, False


def raise_if_stopped() -> None:
    """Re-raise a stop request that TVM's wrapping or a broad `except` swallowed."""
    if _STOP.signum is not None:
        raise stop_exception(_STOP.signum)


class stop_deferred:
    """A block a stop signal must not cut in two (two renames that belong together, a child
    process started but not yet owned): the signal is remembered and raised when it ends."""

    def __enter__(self):
        _STOP.deferring += 1
        return self

    def __exit__(self, *exc):
        _STOP.deferring -= 1
        if not _STOP.deferring and _STOP.pending:
            _STOP.pending = False
            if exc[0] is None:
                raise stop_exception(_STOP.signum)
        return False
