"""What the docs say about kvlab is what kvlab does (issue 32, item 6): the Python version near the top of the
README is pyproject's, CONTRIBUTING gives the suite's real duration, `generate --help` names GGUF files, and
the README's words for demo's first table are the table's own columns."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvlab.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_says_the_python_version_right_after_its_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    after_commands = readme.split("```", 2)[2].split("\n\n", 2)[1]  # the first paragraph after the block
    needed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert needed == ">=3.11" and "Python >= 3.11" in after_commands


def test_contributing_gives_the_suites_measured_duration():
    text = " ".join((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8").split())
    assert "about a minute" not in text
    said = re.search(r"The whole suite takes about (\d+) minutes on 2 cores .*?, and (\d+)-(\d+) minutes cold in CI",
                     text)
    # measured 2026-12-07 on a Zen 3 (AVX2) machine under `-n auto` (two workers) in fresh clones: tests
    # 11m21s and 11m23s cold (`.ci/run` whole 13m30s and 13m24s), 5m14s-5m36s warm, once the one-call block
    # was kept to float32 models (before: 15m06s cold, `.ci/run` 17m42s); 13m13s cold (`.ci/run` 15m18s) and
    # 5m15s warm after the 5-bit codes' layout (2026-12-07, 11:52-12:13 UTC); 16m49s and 17m06s cold (`.ci/run`
    # 19m52s and 17m30s) that afternoon, the VM 20-30 % slower on unchanged kernels (14:19-14:57 UTC); 18m57s
    # undisturbed (`.ci/run` 22m26s, 37m42s of CPU against the morning's 26m10s) after the compile levels
    # were cut (the same tests' compiles 9 % fewer side by side), 2026-12-07 17:46-18:09 UTC; the same code
    # 12m22s cold at 19:09 UTC, and 11m08s at 19:57 with bytecode written and fewer kernel variants (`.ci/run`
    # 13m23s twice, 20:30 and 20:45 UTC)
    assert said and (int(said[1]), int(said[2]), int(said[3])) == (5, 11, 19)


def test_generate_help_names_gguf_files_beside_hf_folders(capsys):
    try:
        main(["generate", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert "Hugging Face folder" in description and "GGUF file" in description


def test_the_readme_describes_demos_first_table_by_its_columns(capsys, monkeypatch):
    import sys

    from rich.console import Console

    import kvlab.cli.demo as demo

    monkeypatch.setattr(demo, "console", lambda: Console(file=sys.stdout, width=200))  # no header wraps
    assert main(["demo"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    row = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `kvlab demo"))
    columns = re.search(r"\(([^)]*)\)", row)[1].split(" / ")
    assert columns == ["work just completed", "positions in each layer's cache", "newly selected token"]
    assert all(column in shown for column in columns)
    assert "timing" not in row and not re.search(r"\d\s*(ms|s)\b", shown.split("K/V rows computed")[0])
