"""The README cannot rot: its opening commands are what CI runs, and every ```python block runs as written.

Python blocks run in order in one namespace (a later block may use names an earlier one defined, as a
reader would), in a fresh temporary directory where `path/to/hf-folder` is the shipped default model. A
block opts out only with the marker comment `# readme-test: skip` on its first line (say why on the same
line); nothing else is skipped. See CONTRIBUTING.md.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_MODEL = ROOT / "kvlab" / "models" / "shakespeare"
PLACEHOLDER_MODEL = Path("path/to/hf-folder")  # the README's stand-in for "your checkpoint folder"
SKIP_MARKER = "# readme-test: skip"
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


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


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block, opted-out ones excluded."""
    blocks = []
    for match in PYTHON_BLOCK.finditer(markdown):
        code = match.group(1)
        if code.lstrip().startswith(SKIP_MARKER):
            continue
        blocks.append((markdown.count("\n", 0, match.start()) + 1, code))
    return blocks


def test_the_extractor_finds_python_blocks_and_honours_only_the_marker():
    text = ("# t\n```bash\necho no\n```\n```python\na = 1\n```\ntext\n```python\n"
            f"{SKIP_MARKER} (needs a server)\nraise SystemExit\n```\n```\nplain = 1\n```\n"
            "```python\n# a comment\nb = a + 1\n```\n")
    assert python_blocks(text) == [(5, "a = 1\n"), (16, "# a comment\nb = a + 1\n")]


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    blocks = python_blocks(readme)
    assert blocks, "README.md has no ```python block"
    (tmp_path / PLACEHOLDER_MODEL).parent.mkdir(parents=True)
    (tmp_path / PLACEHOLDER_MODEL).symlink_to(SHIPPED_MODEL, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for line, code in blocks:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as exc:  # name the block, keep the traceback
            pytest.fail(f"README.md python block at line {line} fails: {type(exc).__name__}: {exc}")
