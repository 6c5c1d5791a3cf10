"""The `shardlm` command's entry point (also `python -m shardlm`).

The command line is imported inside `main`, not at module level: a spawned rank process re-imports the script that
launched the driver, and a rank has no use for typer, rich and the planner (0.23 s of each rank's start-up,
measured). The commands that start rank processes start the fork server their CPU ranks fork from before anything
else, so that its import of torch runs while the driver imports the command line, plans and loads the tokenizer.
"""

from __future__ import annotations

import os
import signal
import sys

RANK_COMMANDS = ("generate", "serve")
"""Commands that start rank processes (on the CPU, forked from the fork server)."""


def starts_cpu_ranks(argv: list[str]) -> bool:
    """Whether the command line `argv` names a command that starts ranks, on the CPU (CUDA ranks are spawned)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    cuda = any(a.startswith("--device=cuda") or (a == "--device" and argv[i + 1:i + 2] != []
                                                 and argv[i + 1].startswith("cuda")) for i, a in enumerate(argv))
    return command in RANK_COMMANDS and "--help" not in argv and not cuda


def start_early(argv: list[str]) -> None:
    """Start the fork server (parallel/launch.py) when `argv` starts CPU ranks; a bad SHARDLM_HUGE_PAGES is left
    for the command to report."""
    if not starts_cpu_ranks(argv):
        return
    from shardlm.parallel.launch import start_fork_server
    from shardlm.settings import Settings, SettingsError

    try:
        huge_pages = Settings.from_env().huge_pages
    except SettingsError:
        return
    start_fork_server(huge_pages)


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C before the command line is up: end now, in one line. A KeyboardInterrupt raised inside an import
    printed a traceback, killed the process by SIGINT, or was swallowed by importlib's lock cleanup so that the run
    went on (40 Ctrl-Cs 0.1-0.3 s after the start: 4 and 1 of them)."""
    launch = sys.modules.get("shardlm.parallel.launch")  # nothing imported here: an import may hold its lock
    if launch is not None and hasattr(launch, "stop_fork_server"):
        launch.stop_fork_server()
    os.write(2, b"error: interrupted\n")
    os._exit(130)


def main() -> None:
    """Run the `shardlm` command line and exit with its status."""
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    start_early(sys.argv[1:])
    from shardlm.cli import main as run

    sys.exit(run())  # it hands Ctrl-C back to Python as it starts the command (cli/app.py)


if __name__ == "__main__":
    main()
