"""The README's code runs as shown: its JSON is valid config, its Python parses and is the runnable
example's own code, its commands name files and flags that exist, and its links resolve."""
import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from ds_seqpar.config import SequenceParallelConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _code(line):
    return line.split("#")[0].strip()


def test_every_json_block_is_a_valid_config():
    blocks = _blocks("json")
    assert blocks, "the README should show a config"
    for block in blocks:
        config = json.loads(block)
        if "sequence_parallel" in config:
            SequenceParallelConfig.from_ds_config(config)


def test_the_strategy_table_rows_are_valid_configs():
    rows = re.findall(r"^\| [^|]+ \| `(\{.*?\})`", README, flags=re.M)
    assert len(rows) >= 6, "the 'which strategy' table should give a config per situation"
    for row in rows:
        value = json.loads(re.sub(r"\b[PUT]\b", lambda m: {"P": "4", "U": "2", "T": "1024"}[m.group()], row))
        SequenceParallelConfig(**value)


def test_python_blocks_parse_and_the_own_loop_is_the_example_code():
    blocks = _blocks("python")
    assert blocks
    for block in blocks:
        ast.parse(block)
    example = {_code(line) for line in (ROOT / "examples" / "own_loop.py").read_text().splitlines()}
    own_loop = next(b for b in blocks if "DS_CONFIG" in b)
    missing = [line for line in map(_code, own_loop.splitlines()) if line and line not in example]
    assert not missing, f"README lines not in examples/own_loop.py: {missing}"


def _commands():
    for block in _blocks("bash"):
        for line in block.splitlines():
            command = _code(line).split("&&")[-1].strip()
            if command and not command.startswith("pip "):
                yield shlex.split(command)


def test_commands_name_existing_files_and_flags():
    from ds_seqpar.train.args import build_parser
    parser = build_parser()
    for argv in _commands():
        for word in argv:
            if re.match(r"(configs|examples|launchers)/", word):
                assert (ROOT / word).exists(), f"{' '.join(argv)}: {word} does not exist"
        if "ds_seqpar.train" in argv:
            flags = argv[argv.index("ds_seqpar.train") + 1:]
            parser.parse_args(flags)     # exits (SystemExit) on an unknown flag


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(page):
    text = (ROOT / page).read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert ((ROOT / page).parent / target).exists(), f"{page}: link {target} does not resolve"
