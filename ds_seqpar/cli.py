"""``ds-seqpar <command> [options]``: one entry point over the package's programs.

Each command is a module with ``main(argv) -> int``; a new one (bench, report) is one line in
COMMANDS. Modules load only when their command runs, so ``ds-seqpar --help`` stays fast.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

# command -> (module with main(argv), one-line help)
COMMANDS = {
    "train": ("ds_seqpar.train.main", "train a small causal LM with sequence x ZeRO data parallelism"),
    "bench": ("ds_seqpar.bench.main", "benchmark a suite ({suites}), side by side in one run: "
                                      "ds-seqpar bench [SUITE] [options]; --list: what each measures"),
    "report": ("ds_seqpar.report.main", "compare training runs (runs/*/metrics.jsonl): tables and plots"),
    "dashboard": ("ds_seqpar.dashboard", "create a saved wandb workspace view comparing strategies (--dry-run: JSON)"),
    "plan": ("ds_seqpar.plan.main", "predict the ranked configurations (strategy, sizes, ZeRO, memory features) "
                                    "for a model, a sequence length and a cluster"),
}


def usage() -> str:
    from .bench.suites import SUITES          # the one list of bench suites (names only: nothing heavy loads)
    width = max(len(c) for c in COMMANDS)
    lines = [f"  {name:<{width}}  {help_.format(suites=', '.join(SUITES))}"
             for name, (_, help_) in sorted(COMMANDS.items())]
    return ("usage: ds-seqpar <command> [options]   (ds-seqpar <command> --help for its options)\n\ncommands:\n"
            + "\n".join(lines))


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the deepspeed launcher puts --local_rank=N before everything: hand it to the command
    launcher_flags = [a for a in argv if a.startswith("--local_rank=")]
    argv = [a for a in argv if not a.startswith("--local_rank=")]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        valid = ", ".join(sorted(COMMANDS))
        print(f"ds-seqpar: unknown command {command!r}; choose one of: {valid}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest + launcher_flags) or 0)


if __name__ == "__main__":
    sys.exit(main())
