"""The `vramguard` command (pip install ".[worker,redis]" in a checkout): up, down, status, check, profile.

Each subcommand's --help explains its options; a wrong option or value is one line on stderr that
starts with the subcommand's name, and exit code 2 (argparse's convention, kept by every
subcommand for its own refusals).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import NoReturn

from vramguard.cli import check, stack, up

EPILOG_UP = ("Environment: VRAMGUARD_PORT (8000), VRAMGUARD_REDIS_PORT (6379), VRAMGUARD_REDIS_URL (an existing "
             "Redis instead of the embedded one), VRAMGUARD_SIM_GPUS (simulate N GPUs), and any VRAMGUARD_* setting "
             "(docs/reference/settings.md). Exit codes: 2 a bad option, setting or placement, nothing started; 1 the "
             "stack could not start (the failing program's error is printed) or a port is taken.")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its error as one line (no usage block): `vramguard up: error: ...`, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")



def installed_version() -> str:
    """This install's version (its package metadata), or "unknown" when run from a checkout that
    was never installed."""
    try:
        return importlib.metadata.version("vramguard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def run_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path,
                        help="the stack's folder, as given to `vramguard up` (default <state dir>/<port> with --port; "
                        "without either, the only stack that runs)")
    parser.add_argument("--port", type=int, default=None,
                        help="the gateway port the stack was started on, to find its run folder: the default one, "
                        "else the running stack with that gateway port (`make up PORT=...`'s, in ./.run) "
                        "(default VRAMGUARD_PORT; without either, the only stack that runs, in the state dir or "
                        "./.run: several are listed, exit code 2)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vramguard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"vramguard {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    up_parser = commands.add_parser("up", help="run the whole stack on this machine, in the foreground",
                                    description=up.__doc__, epilog=EPILOG_UP,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_arguments(up_parser)
    for name, summary, codes in (
        ("down", "stop a stack started earlier by `vramguard up` (also one whose launcher died): supervisor stops "
         "the gateway, the workers, then Redis", "Exit codes: 0 stopped, or nothing ran there; 1 it did not stop "
         f"within {stack.STOP_TIMEOUT_S} s; 2 several stacks run and none was named (they are listed)."),
        ("status", "show whether a stack runs in a run folder, and each of its programs' state",
         "Exit codes: 0 a stack runs; 3 none runs there; 2 several run and none was named (they are listed)."),
    ):
        run_dir_option(commands.add_parser(name, help=summary.split(":")[0], description=f"{summary}. {codes}"))
    check_parser = commands.add_parser("check", help="what `up` would find: GPUs, Redis, models file, placement",
                                       description=check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_arguments(check_parser)
    commands.add_parser("profile", help="measure a model's memory and plan batches (vramguard profile --help)",
                        add_help=False)
    for sub in commands.choices.values():  # main() reports unrecognized arguments through the subcommand's parser
        sub.set_defaults(command_parser=sub)
    return parser


def stack_dir(args: argparse.Namespace) -> Path | int:
    """The run folder `down` and `status` act on: --run-dir, else the default one of --port (or
    VRAMGUARD_PORT), or the running stack whose gateway has that port (`make up`'s, in ./.run), else
    the only stack that runs (stack.choose_stack: an exit code when there is not one)."""
    if args.run_dir is not None:
        return Path(args.run_dir)
    if args.port is None and "VRAMGUARD_PORT" not in os.environ:
        return stack.choose_stack(args.command)
    # The port is checked as `up` checks it: --port 0 must not fall back to 8000's stack.
    port = up.env_port(os.environ, "VRAMGUARD_PORT", args.port, "8000")
    run_dir = stack.default_run_dir(port)
    if stack.running_pid(run_dir) is None:  # `make up PORT=...` runs in ./.run/<port>: the stack on that port
        return stack.stack_on_gateway_port(port) or run_dir
    return run_dir


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:  # its own parser, shared with `python -m vramguard.worker.memory.profile`
        from vramguard.worker.memory.profile import main as profile_main

        return profile_main(argv[1:], prog="vramguard profile")
    # argparse reports arguments no parser took from the top parser (`vramguard: error:`); the
    # subcommand's parser names the command the user ran.
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "up":
            return up.run(args)
        if args.command == "check":
            return check.run(args)
        run_dir = stack_dir(args)
        if isinstance(run_dir, int):
            return run_dir
        ran = stack.running_pid(run_dir) is not None
        code = stack.down(run_dir) if args.command == "down" else stack.status(run_dir)
        if not ran and args.run_dir is None:  # only the default folders are searched: no registry of the others
            print(f"{args.command}: a stack started with --run-dir DIR is found with "
                  f"`vramguard {args.command} --run-dir DIR`")
        return code
    except up.Refused as exc:  # `check` refuses with `up`'s helpers; the line names the command the user ran
        try:
            print(f"{args.command}: {exc}", file=sys.stderr, flush=True)
        except OSError:  # a terminal that is gone (hang-up) still gets the exit code
            pass
        return 2


if __name__ == "__main__":
    sys.exit(main())
