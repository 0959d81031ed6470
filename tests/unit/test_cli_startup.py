"""The command's fixed start-up cost: `megatron-branch --help` imports neither torch nor megatron-core (only the
command on the line is built), and the top-level help lines are the commands' own."""

from __future__ import annotations

import subprocess
import sys

from megatron_branch.cli import COMMANDS, build_parser

HEAVY = ("torch", "megatron", "transformers", "numpy")

PROBE = """
import sys
from megatron_branch.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))
"""


def _imported_by(argv: list[str]) -> str:
    code = PROBE.format(argv=argv, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def test_top_level_help_imports_no_torch() -> None:
    assert _imported_by(["--help"]) == "[]"
    assert _imported_by(["--version"]) == "[]"
    assert _imported_by(["no-such-command"]) == "[]"  # argparse's error: no command module loaded either


def test_train_help_imports_no_torch() -> None:
    assert _imported_by(["train", "--help"]) == "[]"


def _help_lines(parser) -> dict[str, str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return {a.dest: a.help for a in sub._choices_actions}


def test_stub_help_lines_are_the_commands_own() -> None:
    full, stubs = _help_lines(build_parser()), _help_lines(build_parser(""))
    assert full == stubs
    assert list(full) == list(COMMANDS)
    for name in COMMANDS:  # building one command in full keeps the others' lines
        assert _help_lines(build_parser(name)) == full


def test_grad_help_names_the_default_objective() -> None:
    """Issue 35 item 10: `grad --help` said "GRPO loss" while the default objective is pg."""
    default = build_parser("grad")._subparsers._group_actions[0].choices["grad"].get_default("policy_loss")
    assert f"(default --objective {default})" in COMMANDS["grad"][2] and "GRPO" not in COMMANDS["grad"][2]
