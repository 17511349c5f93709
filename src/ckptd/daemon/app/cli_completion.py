"""``ckptd completion bash|zsh``: a shell completion script made from the parser.

Generated, not written by hand, so every command and option (``serve``'s come
from the config) completes as ``--help`` lists it: commands, their options, the
values of options with a fixed set (``--log-level``, ``--wait``), and file names
for everything else. zsh runs the same script through its ``bashcompinit``.

    eval "$(ckptd completion bash)"        # this shell; or, for every shell:
    ckptd completion bash > /etc/bash_completion.d/ckptd
"""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh")


def _options(p: argparse.ArgumentParser) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """A parser's option strings, those that take a value, and each fixed set of values."""
    words: list[str] = []
    valued: list[str] = []
    choices: dict[str, list[str]] = {}
    for action in p._actions:
        words += action.option_strings
        if action.option_strings and action.nargs != 0:
            valued += action.option_strings
            if action.choices is not None:
                for flag in action.option_strings:
                    choices[flag] = [str(c) for c in action.choices]
    return words, valued, choices


def _words(items: list[str]) -> str:
    return shlex.quote(" ".join(items))


def bash_script(parser: argparse.ArgumentParser) -> str:
    """The bash completion function for ``parser`` (a ``complete -F`` script)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top, _, _ = _options(parser)
    cases = []
    for name, p in sub.choices.items():
        words, valued, choices = _options(p)
        fixed = [  # an argument's fixed set of values (completion's shell)
            str(c) for a in p._actions if not a.option_strings and a.choices for c in a.choices
        ]
        value_cases = [
            f'                {flag}) COMPREPLY=($(compgen -W {_words(vals)} -- "$cur")); return ;;'
            for flag, vals in choices.items()
        ]
        free = [f for f in valued if f not in choices]
        if free:  # a path, size, URL...: the shell's default (file names) applies
            value_cases.append(f"                {'|'.join(free)}) return ;;")
        cases.append(
            f"        {name})\n"
            '            case "$prev" in\n'
            + "".join(line + "\n" for line in value_cases)
            + "            esac\n"
            + '            [[ "$cur" == -* ]] && '
            + f'COMPREPLY=($(compgen -W {_words(words)} -- "$cur"))'
            + (f' || COMPREPLY=($(compgen -W {_words(fixed)} -- "$cur"))' if fixed else "")
            + "\n"
            + "            ;;"
        )
    return (
        "# ckptd completion for bash (made by: ckptd completion bash)\n"
        "_ckptd() {\n"
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"\n'
        '    local cmd="" i\n'
        "    for ((i = 1; i < COMP_CWORD; i++)); do\n"
        '        [[ "${COMP_WORDS[i]}" != -* ]] && { cmd="${COMP_WORDS[i]}"; break; }\n'
        "    done\n"
        '    if [[ -z "$cmd" ]]; then\n'
        f'        COMPREPLY=($(compgen -W {_words([*sub.choices, *top])} -- "$cur"))\n'
        "        return\n"
        "    fi\n"
        '    case "$cmd" in\n' + "\n".join(cases) + "\n    esac\n"
        "}\n"
        "complete -o default -F _ckptd ckptd\n"
    )


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """The same completion for zsh, through ``bashcompinit``."""
    return (
        "#compdef ckptd\n"
        "# ckptd completion for zsh (ckptd completion zsh): the bash completion, run by\n"
        "# zsh's bashcompinit (load compinit first, as most zsh setups do)\n"
        "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser)
    )


def cmd_completion(args: argparse.Namespace) -> int:
    """Print the completion script for ``args.shell``."""
    parser: argparse.ArgumentParser = args.parser
    print(bash_script(parser) if args.shell == "bash" else zsh_script(parser), end="")
    return 0


def add_completion_parser(
    parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    """Register ``completion`` on the main parser (``parser``, which it completes:
    call it once every other command is added)."""
    p = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh)",
        description='Print a completion script: eval "$(ckptd completion bash)" in ~/.bashrc, '
        "or save it as /etc/bash_completion.d/ckptd; for zsh, "
        'eval "$(ckptd completion zsh)" in ~/.zshrc after compinit.',
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(fn=cmd_completion, parser=parser)
