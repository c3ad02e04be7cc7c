"""The command line starts light: `fedvl --help` and every command's `--help` without importing
torch, and no parser takes abbreviated flags."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from fedvl.cli import COMMANDS, build_parser, main

# Prints the heavy packages a `fedvl ARGS` start-up imported (the command exits through argparse).
PROBE = """
import sys
from fedvl.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("LOADED", sorted(m for m in ("torch", "flwr", "matplotlib", "ray") if m in sys.modules))
"""


def loaded(*args: str) -> tuple[str, list[str]]:
    """stdout of `fedvl ARGS` in a fresh interpreter, and the heavy packages it imported."""
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         check=True).stdout
    line = out.strip().splitlines()[-1]
    return out, eval(line.removeprefix("LOADED "))  # noqa: S307 - our own printed list


def test_help_lists_every_command_without_torch() -> None:
    out, heavy = loaded("--help")
    assert heavy == []
    for name in COMMANDS:
        assert f"    {name}" in out


@pytest.mark.parametrize("command", ["perf", "report", "privacy", "run", "bench", "tune",
                                     "distill", "heterogeneity"])
def test_help_of_every_command_starts_without_torch(command: str) -> None:
    assert loaded(command, "--help")[1] == []


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subcommand parser below it."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += parsers(sub)
    return out


def test_no_parser_takes_abbreviations() -> None:
    everything = parsers(build_parser())
    assert len(everything) > len(COMMANDS)   # flower's own subcommands are walked too
    assert all(p.allow_abbrev is False for p in everything)


@pytest.mark.parametrize("argv", [["run", "--round", "2"], ["flower", "simulate", "--round", "2"],
                                  ["--round", "2"]])
def test_abbreviated_flag_is_one_error_line(argv: list[str], capsys: pytest.CaptureFixture
                                            ) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --round 2" in err[0]


def test_command_table_matches_the_modules_help() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert helps == {name: text for name, (_, text) in COMMANDS.items()}
