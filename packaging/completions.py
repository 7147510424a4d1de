"""The bash, zsh and fish completions of ``llmgw``, from click's own shell completion: each
script calls back into ``llmgw`` (``_LLMGW_COMPLETE=bash_complete llmgw ...``), so it
completes every subcommand and option the program has, and the values that the commands'
``shell_complete`` callbacks offer (pending nodes for ``llmgw ctl approve``, node and model
names: llmgw/cli/ctl/complete.py).

usage: completions.py --out DIR    (writes DIR/llmgw.bash, DIR/_llmgw, DIR/llmgw.fish)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["FILES", "scripts"]

PROG = "llmgw"
COMPLETE_VAR = "_LLMGW_COMPLETE"
# Each shell's script and the file name it is installed under (the packages put them in
# /usr/share/bash-completion/completions/llmgw, .../zsh/vendor-completions/_llmgw (Debian)
# or .../zsh/site-functions/_llmgw (Fedora), /usr/share/fish/vendor_completions.d/llmgw.fish).
FILES = {"bash": "llmgw.bash", "zsh": "_llmgw", "fish": "llmgw.fish"}


def scripts() -> dict[str, str]:
    """File name -> script, one for each shell."""
    from click.shell_completion import get_completion_class

    from llmgw.cli import main as cli

    out = {}
    for shell, name in FILES.items():
        completion = get_completion_class(shell)
        if completion is None:
            raise RuntimeError(f"click has no {shell} completion; upgrade click")
        source = completion(cli, {}, PROG, COMPLETE_VAR).source()
        if shell == "zsh" and not source.startswith("#compdef"):
            # zsh's compinit finds a completion file by its first line.
            source = f"#compdef {PROG}\n\n{source}"
        out[name] = source if source.endswith("\n") else source + "\n"
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="completions.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, text in scripts().items():
            path = args.out / name
            path.write_text(text, encoding="utf-8")
            path.chmod(0o644)
    except (OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
