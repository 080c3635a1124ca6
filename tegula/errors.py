"""Errors raised to users: every compile error carries the user's file and line."""
from __future__ import annotations


class CompileError(Exception):
    """A kernel that cannot be compiled.

    ``loc`` is ``(filename, lineno)`` of the user's construct; ``detail`` (e.g. a C compiler's log)
    is attached below our own message, never shown alone.
    """

    def __init__(self, msg: str, loc: tuple[str, int] | None = None, detail: str | None = None):
        self.msg, self.loc, self.detail = msg, loc, detail
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"{self.loc[0]}:{self.loc[1]}: {self.msg}" if self.loc else self.msg
        if self.detail:
            text += "\n--- details ---\n" + self.detail.rstrip()
        return text

    def with_loc(self, loc) -> "CompileError":
        """Attach ``loc`` if the error does not carry one yet (the innermost location wins)."""
        if self.loc is None and loc is not None:
            self.loc = loc
            self.args = (self._render(),)
        return self
