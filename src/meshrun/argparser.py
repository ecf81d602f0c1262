"""The ArgumentParser of every meshrun command line: a mistyped flag, subcommand or choice gets a
did-you-mean. The rule is written once here, and every subcommand's parser uses it.

    meshrun generate runs/x --max-tokens 5   ->  unknown flag --max-tokens; did you mean --max-new-tokens?
    meshrun ckpt exprot CKPT OUT             ->  invalid choice: 'exprot'; did you mean 'export'? (choose from ...)

`Parser` keeps argparse's form of an error: the usage line, then `PROG: error: ...`, and exit 2.
`OneLineParser` raises one LaunchError line instead. Subparsers made with `add_parser` get their
parent's class, and an unknown flag after a subcommand is reported with that subcommand's usage
(`meshrun ckpt list: error: ...`). `meshrun train` checks its flags before it parses them (a
config key's name gets `--set`), and uses `unknown_flag` here for the rest. Python 3.11's
argparse suggests nothing. Torch-free.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable

from meshrun.errors import LaunchError

CUTOFF = 0.6  # difflib's default; the names are compared without dashes, case or _ vs -
_REQUIRED = "the following arguments are required"  # argparse's message when one is missing
_NUMBER = re.compile(r"^-\.?\d")  # -1, -0.5, -.5: a value, not a flag


def _name(flag: str) -> str:
    return flag.lstrip("-").replace("_", "-").lower()


def closest_flag(flag: str, options: Iterable[str]) -> str | None:
    """The option string nearest to `flag` (`--max-tokens` -> `--max-new-tokens`, `--max_new_tokens`
    -> `--max-new-tokens`); the first spelling of a name wins. None when no option is near."""
    by_name: dict[str, str] = {}
    for option in options:
        by_name.setdefault(_name(option), option)
    name = _name(flag)
    close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=CUTOFF) if name else []
    return by_name[close[0]] if close else None


def unknown_flag(flag: str, options: Iterable[str], hint: str | None = None, fallback: str | None = None) -> str:
    """`unknown flag --max-tokens; did you mean --max-new-tokens?`: `hint` when given (a better fix,
    e.g. `--set`), else the nearest of `options`, else `fallback`."""
    if hint is None:
        close = closest_flag(flag, options)
        hint = f"did you mean {close}?" if close else fallback
    return f"unknown flag {flag}" + (f"; {hint}" if hint else "")


def _is_flag(token: str, prefix_chars: str = "-") -> bool:
    return len(token) > 1 and token[0] in prefix_chars and token != "--" and not _NUMBER.match(token)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


class Parser(argparse.ArgumentParser):
    """argparse, plus a did-you-mean for an unknown flag, subcommand or choice (see the module)."""

    _given: tuple[str, ...] = ()  # the arguments this parser (or subparser) was last given

    def parse_known_args(self, args=None, namespace=None):
        self._given = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chain = self._chain(parsed)
            flags = [token for token in extras if _is_flag(token, self.prefix_chars)]
            if flags:
                chain[-1].error(self._unknown(flags[0].partition("=")[0], chain))
            chain[-1].error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str):  # type: ignore[override]
        super().error(self.explain(message))

    def explain(self, message: str) -> str:
        """argparse's message, unless a flag this parser was given is unknown: a missing required
        argument is then most likely that flag mistyped (`--output DIR` for `--out DIR`)."""
        if message.startswith(_REQUIRED):
            flag = self._first_unknown(self._given)
            if flag is not None:
                return unknown_flag(flag, self._options())
        return message

    def _options(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]

    def _first_unknown(self, tokens: Iterable[str]) -> str | None:
        known = self._option_string_actions
        for token in tokens:
            if token == "--":
                return None
            if not _is_flag(token, self.prefix_chars):
                continue
            flag = token.partition("=")[0]
            if flag in known or (flag[1] not in self.prefix_chars and flag[:2] in known):  # -r3: -r with 3
                continue
            if self.allow_abbrev and any(option.startswith(flag) for option in known if len(option) > 2):
                continue  # an abbreviation argparse takes (or calls ambiguous)
            return flag
        return None

    def _chain(self, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
        """This parser and the subcommand parsers `parsed` went through, outermost first."""
        chain: list[argparse.ArgumentParser] = [self]
        while (sub := _subparsers(chain[-1])) is not None and sub.dest != argparse.SUPPRESS:
            inner = sub.choices.get(getattr(parsed, sub.dest, None))
            if not isinstance(inner, argparse.ArgumentParser):
                break
            chain.append(inner)
        return chain

    def _unknown(self, flag: str, chain: list[argparse.ArgumentParser]) -> str:
        inner = chain[-1]
        if len(chain) > 1 and flag in inner._option_string_actions:  # given before the subcommand
            return f"{flag} goes after the subcommand: {inner.prog} ... {flag}"
        options = [flag for parser in reversed(chain) for action in parser._actions for flag in action.option_strings]
        return unknown_flag(flag, options)

    def _check_value(self, action: argparse.Action, value) -> None:
        """argparse's check of `choices=` and subcommand names, with the nearest choice named."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            names = [str(choice) for choice in action.choices or ()]
            close = difflib.get_close_matches(value, names, n=1, cutoff=CUTOFF) if isinstance(value, str) else []
            if not close:
                raise
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean {close[0]!r}? "
                                                 f"(choose from {', '.join(map(repr, names))})") from None


class OneLineParser(Parser):
    """A Parser whose errors are one LaunchError line naming the fix, not a usage block."""

    def error(self, message: str):  # type: ignore[override]
        raise LaunchError(f"{self.explain(message)} (see `{self.prog} --help`)")
