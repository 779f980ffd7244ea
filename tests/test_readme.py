"""The README opens with the two commands a fresh machine runs; CI must run the second one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README must open with a code block of commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_two_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert "kvlab" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1].replace("pip install -e", "pip install -q -e") in ci
