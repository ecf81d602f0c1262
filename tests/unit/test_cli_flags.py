"""Every subcommand's command line: a mistyped flag, subcommand or choice gets a did-you-mean
(meshrun.argparser), in process, through `meshrun.cli.main` as the console script runs it."""

from __future__ import annotations

import pytest

from meshrun.cli import COMMANDS, main


def run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `meshrun ARGV`; argparse's own errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one `error:` line of stderr: the last line (argparse's usage block comes above it)."""
    lines = err.strip().splitlines()
    assert [line for line in lines if ": error: " in line] == lines[-1:], err
    return lines[-1]


# (argv, the program named in the error, the flag, the suggestion): every subcommand
MISTYPED = [
    (["train", "--profil", "3"], "meshrun train", "--profil", "--profile"),
    (["launch", "--rank0-onyl", "train.py"], "meshrun launch", "--rank0-onyl", "--rank0-only"),
    (["generate", "runs/x", "--max-tokens", "5"], "meshrun generate", "--max-tokens", "--max-new-tokens"),
    (["generate", "runs/x", "--max-tokens=5"], "meshrun generate", "--max-tokens", "--max-new-tokens"),
    (["generate", "runs/x", "--max_new_tokens", "5"], "meshrun generate", "--max_new_tokens", "--max-new-tokens"),
    (["ckpt", "list", "runs/x", "--hepl"], "meshrun ckpt list", "--hepl", "--help"),
    (["ckpt", "inspect", "runs/x/checkpoints/step-1", "--jsn"], "meshrun ckpt inspect", "--jsn", "--json"),
    (["ckpt", "export", "ckpt", "out", "--fromat", "hf"], "meshrun ckpt export", "--fromat", "--format"),
    (["data", "prepare", "book.txt", "--output", "data/book"], "meshrun data prepare", "--output", "--out"),
    (["config", "show", "--sett", "optim.lr=1"], "meshrun config show", "--sett", "--set"),
    (["plan", "--wrld", "4"], "meshrun plan", "--wrld", "--world"),
    (["report", "runs/x", "--fromat", "svg"], "meshrun report", "--fromat", "--format"),
    (["diagnose", "runs/x", "--jsn"], "meshrun diagnose", "--jsn", "--json"),
    (["doctor", "--skip-smoek"], "meshrun doctor", "--skip-smoek", "--skip-smoke"),
    (["submit", "c.toml", "--dry-rn"], "meshrun submit", "--dry-rn", "--dry-run"),
]


def test_the_cases_cover_every_subcommand():
    assert {argv[0] for argv, *_ in MISTYPED} == set(COMMANDS)


@pytest.mark.parametrize(("argv", "prog", "flag", "suggestion"), MISTYPED, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_an_unknown_flag_names_the_nearest_one(capsys, argv, prog, flag, suggestion):
    code, err = run(argv, capsys)
    assert code == 2
    line = error_line(err)
    assert line.startswith(f"{prog}: error: unknown flag {flag}; did you mean {suggestion}?"), line


def test_generate_max_tokens_is_one_line(capsys):
    code, err = run(["generate", "runs/x", "--max-tokens", "5"], capsys)
    assert code == 2
    assert err == ("meshrun generate: error: unknown flag --max-tokens; did you mean --max-new-tokens? "
                   "(see `meshrun generate --help`)\n")


def test_a_flag_near_nothing_is_named_without_a_guess(capsys):
    code, err = run(["report", "runs/x", "--zzzzzz"], capsys)
    assert code == 2 and error_line(err) == "meshrun report: error: unknown flag --zzzzzz"


def test_a_flag_that_is_a_config_key_still_suggests_set(capsys):
    code, err = run(["train", "--steps", "20"], capsys)
    assert code == 2
    assert err == "meshrun train: error: unknown flag --steps; did you mean `--set train.steps=20`?\n"


def test_a_subcommands_flag_before_the_subcommand_says_where_it_goes(capsys):
    code, err = run(["ckpt", "--json", "inspect", "runs/x/checkpoints/step-1"], capsys)
    assert code == 2
    assert error_line(err) == "meshrun ckpt inspect: error: --json goes after the subcommand: meshrun ckpt inspect ... --json"


@pytest.mark.parametrize(("argv", "typo", "meant"), [
    (["ckpt", "exprot", "ckpt", "out"], "exprot", "export"),
    (["config", "shwo"], "shwo", "show"),
    (["data", "prepaer", "book.txt"], "prepaer", "prepare"),
    (["ckpt", "export", "ckpt", "out", "--format", "saftensors"], "saftensors", "safetensors"),
])  # fmt: skip
def test_a_mistyped_subcommand_or_choice_names_the_nearest(capsys, argv, typo, meant):
    code, err = run(argv, capsys)
    assert code == 2
    assert f"invalid choice: {typo!r}; did you mean {meant!r}? (choose from " in error_line(err)


def test_launch_still_hands_unknown_flags_after_the_script_to_it():
    from meshrun.launch.args import build_parser

    args = build_parser().parse_args(["--nproc-per-node", "2", "train.py", "--max-tokens", "5", "--lr=3"])
    assert (args.training_script, args.training_script_args) == ("train.py", ["--max-tokens", "5", "--lr=3"])
