"""What every command shares: the consoles, the one-line failure, and the option conflicts rule."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 2, status=None, view=None) -> None:
    """Print `message` as one error line on stderr and exit with `code` (2: bad input)."""
    if status is not None:
        status.stop()
    if view is not None:
        view.close()
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def refuse_conflicts(given: dict[str, object], against: str, why: str) -> None:
    """Exit with one line when any option in `given` (flag -> value, None when not given) was passed
    together with `against`, which already decides it (`why` says how)."""
    clash = [f"{flag} {value}" if value is not True else flag for flag, value in given.items()
             if value is not None and value is not False]
    if clash:
        fail(f"{', '.join(clash)} cannot be combined with {against}, which {why}; drop "
             f"{' and '.join(c.split()[0] for c in clash)} or change {against}")
