"""llama.cpp's structured-output flags on `kvlab generate` and `kvlab chat` (the shipped model, subprocesses):
the answer matches, and every bad grammar or schema exits 2 with one line naming the flag, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mood", "line"],
          "properties": {"mood": {"enum": ["merry", "sad"]}, "line": {"type": "string", "maxLength": 20}}}


def kvlab(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_generate_with_a_json_schema_prints_a_valid_answer(temperature):
    done = kvlab("generate", "ROMEO:", "-n", "80", "--temperature", temperature, "--no-display-prompt",
                 "--json-schema", json.dumps(SCHEMA))
    assert done.returncode == 0, done.stderr
    assert "stop: eos" in done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMA)


def test_generate_with_a_gbnf_grammar_file(tmp_path):
    path = tmp_path / "answer.gbnf"
    path.write_text('root ::= ("aye" | "nay") ", my " ("lord" | "lady") "."\n')
    done = kvlab("generate", "KING:", "-n", "30", "--seed", "4", "--temperature", "1", "--no-display-prompt",
                 "--grammar-file", str(path))
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"(aye|nay), my (lord|lady)\.\n", done.stdout), done.stdout


def test_chat_answers_every_turn_with_the_schema(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    done = kvlab("chat", "-n", "80", "--temperature", "0", "--json-schema-file", str(path),
                 stdin="Who goes there?\nSpeak again.\n")
    assert done.returncode == 0, done.stderr
    replies = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(replies) == 2
    for reply in replies:
        jsonschema.validate(json.loads(reply), SCHEMA)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, needle", [
    (["--grammar", 'root ::= "a" ('], "--grammar: invalid grammar"),
    (["--grammar", "root ::= undefined"], "--grammar: invalid grammar"),
    (["--json-schema", '{"type": "foo"}'], "--json-schema: invalid JSON schema"),
    (["--json-schema", "{not json"], "--json-schema: the JSON schema is not valid JSON"),
    (["--grammar-file", "/no/such/file.gbnf"], "--grammar-file /no/such/file.gbnf: cannot read it"),
    (["--json-schema", "{}", "--grammar", 'root ::= "a"'], "give one of --grammar and --json-schema"),
])
def test_bad_grammars_exit_2_with_one_line(command, flags, needle):
    args = [command, "ROMEO:", *flags] if command == "generate" else [command, *flags]
    done = kvlab(*args, stdin="hello\n")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_ignore_eos_with_a_grammar_is_refused():
    done = kvlab("generate", "ROMEO:", "--ignore-eos", "--json-schema", "{}")
    assert done.returncode == 2 and "--ignore-eos cannot be combined with a grammar" in done.stderr
