"""The `shardlm` command line: one Typer app, its commands registered here, run by `main`.

The command modules (generate, plan, ckpt, eval) define plain functions and import nothing from
here, so the package has no import circle; this module registers them. `main` runs the app without
click's standalone handling, so that every usage error (a bad option value, a missing argument) is
printed the way shardlm prints every error: one line on stderr, exit status 2.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

import typer
from rich.markup import escape

from shardlm import logs
from shardlm.cli import ckpt, eval as evaluate, generate, plan, serve, top
from shardlm.cli.common import err

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models sharded across processes and devices.")


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details (rank by rank).")) -> None:
    """shardlm: plan, shard and run language models across devices."""
    logs.setup(logging.INFO if verbose else logging.WARNING, "driver")  # ranks take the driver's level


app.command()(generate.generate)
app.command()(serve.serve)
app.command()(top.top)
for _command in (plan.inspect, plan.plan, plan.validate, plan.calibrate, ckpt.shard, ckpt.reshard, ckpt.consolidate,
                 ckpt.convert, ckpt.verify, evaluate.perplexity):
    app.command()(_command)


def main(argv: list[str] | None = None) -> int:
    """Run the command line on `argv` (default sys.argv[1:]); returns the exit status."""
    command = typer.main.get_command(app)
    try:
        if threading.current_thread() is threading.main_thread():  # Ctrl-C as KeyboardInterrupt from here on (the
            signal.signal(signal.SIGINT, signal.default_int_handler)  # entry point ends start-up's Ctrl-C itself)
        code = command.main(args=argv, prog_name="shardlm", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        err.print("[bold red]error:[/] interrupted", highlight=False)
        return 130
    except typer.TyperException as e:  # a usage error: a bad option value, a missing argument
        if type(e).__name__ == "NoArgsIsHelpError":
            typer.echo(e.format_message())
            return 0
        err.print(f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True)
        return getattr(e, "exit_code", 2)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
