"""Every subcommand x its flags x bad values, and bad stdin: one stderr line, exit code != 0, no traceback.

Run in-process through `kvlab.cli.main(argv)` (hundreds of Python start-ups would take minutes on a shared
machine); a handful at the end run as real subprocesses, for what only a process shows: bytes in argv that
are not UTF-8, the exit code the shell sees, --debug's traceback. The folder of bad files is checked
byte for byte after every case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adversarial import TALLY, cli_refuses, run_cli, tree_state


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """Files a user might point kvlab at by mistake."""
    root = tmp_path_factory.mktemp("bad")
    (root / "folder").mkdir()
    (root / "binary.bin").write_bytes(b"\x00\x01\xff\xfe" * 64)
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    os.symlink(root / "loop", root / "loop")
    (root / "broken.json").write_text("{")
    (root / "list.json").write_text("[1, 2]")
    (root / "nan.json").write_text('{"vocab_size": NaN}')
    bad_config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 0}
    (root / "theta0.json").write_text(json.dumps(bad_config))
    (root / "string_tie.json").write_text(json.dumps({**bad_config, "rope_theta": 1e4,
                                                      "tie_word_embeddings": "false"}))
    (root / "garbage.session").write_bytes(os.urandom(256))
    (root / "folder" / "config.json").mkdir()  # a folder where config.json should be
    return root


MISSING = "{bad}/no/such/path"
PATHS = {"missing": MISSING, "folder": "{bad}/folder", "loop": "{bad}/loop", "binary": "{bad}/binary.bin"}
NUMBERS = ["nan", "inf", "-inf", "1e400", "x", ""]

CASES: list[tuple[str, list[str]]] = []


def case(label: str, *argv: str) -> None:
    CASES.append((label, list(argv)))


# global
case("no command")
case("unknown command", "bogus")
case("unknown flag", "memory", "--bogus")
for command in ("generate", "chat", "verify", "memory", "demo", "perplexity"):
    case(f"{command} unknown flag", command, "--no-such-flag", "1")
# generate: sampling and length flags
for flag in ("--temperature", "--top-p", "--min-p"):
    for value in NUMBERS + ["-1", "2" if flag != "--temperature" else "1e-310"]:
        case(f"generate {flag} {value}", "generate", flag, value, "hi")
case("generate --top-p 0", "generate", "--top-p", "0", "hi")
for value in ["-2", "1.5", "x", "", "18446744073709551616"]:
    case(f"generate --seed {value}", "generate", "--seed", value, "hi")
for value in ["-2", "1.5", "x", ""]:
    case(f"generate --top-k {value}", "generate", "--top-k", value, "hi")
for value in ["0", "-2", "1.5", "x", ""]:
    case(f"generate -n {value}", "generate", "-n", value, "hi")
for value in ["int3", "", "float8"]:
    case(f"generate --kv-cache-dtype {value}", "generate", "--kv-cache-dtype", value, "hi")
case("generate --dtype float16", "generate", "--dtype", "float16", "hi")
for kind, path in PATHS.items():
    case(f"generate --model {kind}", "generate", "--model", path, "hi")
for kind in ("folder", "loop", "binary"):
    case(f"generate --prompt-cache {kind}", "generate", "-n", "2", "--prompt-cache", PATHS[kind], "hi")
case("generate --prompt-cache garbage", "generate", "-n", "2", "--prompt-cache", "{bad}/garbage.session", "hi")
case("generate --model folder with config.json folder", "generate", "--model", "{bad}/folder", "hi")
case("generate too long", "generate", "-n", "2", "x " * 3000)
case("generate --chat without template", "generate", "--chat", "--model", "{bad}/folder", "hi")
# chat (flags are checked before any line is read)
for flag, values in (("--temperature", NUMBERS + ["-1"]), ("--top-p", ["0", "2", "nan"]),
                     ("--min-p", ["-0.5", "nan"]), ("--top-k", ["-2", "x"]), ("--seed", ["-2", "x"]),
                     ("-n", ["0", "-1", "x"]), ("--kv-cache-dtype", ["int3"]), ("--tiny-seed", ["-1", "x"])):
    for value in values:
        case(f"chat {flag} {value}", "chat", "--tiny", flag, value)
for kind, path in PATHS.items():
    case(f"chat --model {kind}", "chat", "--model", path)
# verify
for value in NUMBERS + ["-1", "-0.5"]:
    case(f"verify --tolerance {value}", "verify", "--tolerance", value)
for value in ["-1", "x", "1.5"]:
    case(f"verify --seed {value}", "verify", "--seed", value)
for value in ["0", "1", "-5", "x"]:
    case(f"verify --length {value}", "verify", "--length", value)
case("verify --dtype float16", "verify", "--dtype", "float16")
case("verify --bidirectional --model", "verify", "--bidirectional", "--model", "default")
for kind, path in PATHS.items():
    case(f"verify --model {kind}", "verify", "--model", path)
# memory
for value in ["1e400", "-5", "nan", "inf", "8XB", "", "GiB", "1e19"]:
    case(f"memory --budget {value}", "memory", "--budget", value)
for value in ["0", "-1", "x", "1e3", "99999999999999999999"]:
    case(f"memory --batch {value}", "memory", "--batch", value)
for value in ["-1", "x", "99999999999999999999"]:
    case(f"memory --tokens {value}", "memory", "--tokens", value)
case("memory --dtype int3", "memory", "--dtype", "int3")
for name in ("missing", "folder", "loop", "binary"):
    case(f"memory --config {name}", "memory", "--config", PATHS[name])
for name in ("latin1.txt", "broken.json", "list.json", "nan.json", "theta0.json", "string_tie.json"):
    case(f"memory --config {name}", "memory", "--config", f"{{bad}}/{name}")
# demo
for value in ["0", "-1", "x", "100000"]:
    case(f"demo --steps {value}", "demo", "--steps", value)
for value in ["-1", "x"]:
    case(f"demo --seed {value}", "demo", "--seed", value)
case("demo empty prompt", "demo", "")
case("demo prompt past the context", "demo", "x" * 3000)
# perplexity
for kind, path in PATHS.items():
    case(f"perplexity --text {kind}", "perplexity", "--text", path)
case("perplexity --text latin1", "perplexity", "--text", "{bad}/latin1.txt")
for flag in ("--context", "--stride", "--max-tokens", "--chunk"):
    for value in ["0", "-3", "x"]:
        case(f"perplexity {flag} {value}", "perplexity", flag, value)
case("perplexity --context past the model", "perplexity", "--context", "100000", "--max-tokens", "10")
for value in ["float16", "foo", "int8"]:
    case(f"perplexity --dtype {value}", "perplexity", "--dtype", value)
case("perplexity --kv-cache-dtype int3", "perplexity", "--kv-cache-dtype", "int3", "--max-tokens", "10")
for kind, path in PATHS.items():
    case(f"perplexity --model {kind}", "perplexity", "--model", path)


@pytest.mark.parametrize("label,argv", CASES, ids=[label for label, _ in CASES])
def test_bad_flags_give_one_line(label, argv, bad, capsys, monkeypatch):
    argv = [a.replace("{bad}", str(bad)) for a in argv]
    cli_refuses(argv, capsys, monkeypatch, watch=bad)


STDIN = {
    "non-UTF-8": b"caf\xe9\n",
    "binary": b"\x00\x01\x02\xff" * 16,
    "truncated UTF-8": "😀".encode()[:3],
    "huge": b"to be or not " * 100_000,
}


@pytest.mark.parametrize("name", sorted(STDIN))
def test_bad_stdin_for_generate(name, bad, capsys, monkeypatch):
    cli_refuses(["generate", "-n", "2"], capsys, monkeypatch, stdin=STDIN[name], watch=bad)


def test_bad_stdin_lines_in_chat_keep_the_conversation(capsys, monkeypatch):
    """A chat reports each bad line and goes on; the exchanges around it are all answered."""
    TALLY["tried"] += 3
    script = b"hello\n\xff\xfe\n\x00binary\xff\nthere\n" + "😀".encode()[:2] + b"\n/quit\n"
    code, out, err = run_cli(["chat", "--tiny", "-n", "3", "--temperature", "0"], capsys, monkeypatch, script)
    assert code == 0 and "Traceback" not in err
    assert err.count("not valid UTF-8") == 3
    assert err.count("[prompt ") == 2  # both good messages answered, history kept across the bad lines
    TALLY["clean"] += 3


def test_a_huge_line_in_chat_is_refused_and_the_chat_goes_on(capsys, monkeypatch):
    TALLY["tried"] += 1
    script = b"hello\n" + b"to be or not " * 50_000 + b"\nthere\n"
    code, out, err = run_cli(["chat", "--tiny", "-n", "3", "--temperature", "0"], capsys, monkeypatch, script)
    assert code == 0 and "Traceback" not in err
    assert "does not fit" in err and err.count("[prompt ") == 2
    TALLY["clean"] += 1


def test_empty_stdin_is_not_an_error(capsys, monkeypatch):
    code, _, err = run_cli(["chat", "--tiny", "-n", "2"], capsys, monkeypatch, b"")
    assert code == 0 and err == ""


# --- real processes -------------------------------------------------------------------------------------
def kvlab_process(*args: bytes | str, stdin: bytes = b"", env: dict | None = None
                  ) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvlab", *[a.encode() if isinstance(a, str) else a for a in args]]
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent, env=env)


def assert_one_line(proc: subprocess.CompletedProcess) -> None:
    TALLY["tried"] += 1
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    TALLY["clean"] += 1


def test_processes_non_utf8_argv_and_stdin(bad):
    before = tree_state(bad)
    assert_one_line(kvlab_process("generate", b"caf\xe9"))
    assert_one_line(kvlab_process("memory", "--config", b"\xff\xfe.json"))
    assert_one_line(kvlab_process("generate", "-n", "2", stdin=b"\xff\xfe\x00"))
    assert_one_line(kvlab_process("memory", "--budget", "1e400"))
    assert_one_line(kvlab_process("verify", "--seed", "-1"))
    assert tree_state(bad) == before


def test_debug_shows_the_traceback():
    plain = kvlab_process("demo", "--steps", "0")
    assert plain.returncode == 2 and b"Traceback" not in plain.stderr
    debug = kvlab_process("--debug", "demo", "--steps", "0")
    assert debug.returncode != 0 and b"Traceback" in debug.stderr and b"--steps" in debug.stderr
    after = kvlab_process("demo", "--steps", "0", "--debug")
    assert b"Traceback" in after.stderr


def test_seed_minus_one_means_random(capsys, monkeypatch):
    """llama.cpp's `--seed -1`: accepted, and two runs need not agree (a fresh seed each time)."""
    outs = set()
    for _ in range(3):
        code, out, err = run_cli(["generate", "-n", "12", "--seed", "-1", "--temperature", "1.5",
                                  "--no-display-prompt", "To be"], capsys, monkeypatch)
        assert code == 0, err
        outs.add(out)
    assert len(outs) > 1
