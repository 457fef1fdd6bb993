from __future__ import annotations


class OverlayError(Exception):
    """A failure the user can act on.

    ``what`` names the file or value that is wrong; ``next_step`` says what
    to do about it. The CLI prints both and exits non-zero.
    """

    def __init__(self, what: str, next_step: str) -> None:
        super().__init__(f"{what}\n  next: {next_step}")
        self.what = what
        self.next_step = next_step
