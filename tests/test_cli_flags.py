"""Flags as users type them (issue 32, item 5): `-m` wherever `--model` is, `kvlab serve MODEL` as vLLM takes
it, and an unknown flag answered by the subcommand that was given it, with that subcommand's usage."""

from __future__ import annotations

import argparse
import json

import pytest

from kvlab.cli import COMMANDS, build_parser, main


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_with_a_model_flag_takes_dash_m_for_it():
    with_model = {name: p for name, p in subcommands().items()
                  if any("--model" in a.option_strings for a in p._actions)}
    assert {"generate", "chat", "serve", "verify", "memory"} <= set(with_model)
    parser = build_parser()
    for name, sub in with_model.items():
        model = next(a for a in sub._actions if "--model" in a.option_strings)
        assert "-m" in model.option_strings, name
        extra = ["a prompt"] if name == "generate" else []
        assert getattr(parser.parse_args([name, "-m", "x.gguf", *extra]), model.dest) == "x.gguf", name


def test_memory_dash_m_reads_the_model_it_names(capsys):
    from kvlab.hf.loader import resolve_model_dir

    folder = str(resolve_model_dir(None))  # the shipped model's folder
    assert main(["memory", "-m", folder, "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert main(["memory", "--model", folder, "--json"]) == 0
    assert short == json.loads(capsys.readouterr().out) and short["model"] == folder


def test_serve_takes_the_model_as_its_positional_argument():
    from kvlab.cli.serve import build_engine
    from kvlab.hf.loader import resolve_model_dir

    folder = str(resolve_model_dir(None))
    parser = build_parser()
    engine, _, name, root = build_engine(parser.parse_args(["serve", folder, "--num-blocks", "4"]))
    assert name == folder and root == folder
    engine.close(0)


def test_serve_refuses_two_different_models_before_loading(capsys):
    assert main(["serve", "one-model", "--model", "another-model"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("kvlab serve: error: two models given: one-model and --model another-model; "
                           "give one")


REQUIRED = {"generate": ["a prompt"], "convert": ["in.gguf", "out"], "quantize": ["src", "out.gguf", "--type", "q8_0"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_flag_shows_that_commands_usage(command, capsys):
    extra = REQUIRED.get(command, [])
    with pytest.raises(SystemExit) as exit_:
        main([command, *extra, "--no-such-flag=3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvlab {command} [-h]")
    assert err.rstrip().splitlines()[-1] == (f"kvlab {command}: error: unrecognized arguments: --no-such-flag=3 "
                                             f"(see kvlab {command} --help)")
    assert "see kvlab --help" not in err


def test_a_flag_before_the_command_is_still_kvlabs_own_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--no-such-flag", "demo"])
    assert exit_.value.code == 2 and "see kvlab --help" in capsys.readouterr().err
