"""The documents hold: in README.md and docs/*.md every relative link and anchor exists, every repository path in
backticks exists, every `make` target is in the Makefile, every `pagoda ...` / `python -m pagoda...` command parses
against its argparse parser, and every PAGODA_* variable is a setting of shared/config.py (or a compose-level or
test-only variable). No server, no model: parsers are built, never run."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.cli import build_parser
from pagoda.shared.config import add_engine_args, add_server_args, env_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
MAKE = re.compile(r"(?:^|[\s;&(])make\s+((?:[a-z][\w-]*\s*)+)")
COMMAND = re.compile(r"(?:^|\s)(?:\S*/)?(pagoda|python3? -m pagoda(?:\.[\w.]+)?)(?=\s|$)(.*)")
ENV = re.compile(r"\bPAGODA_[A-Z0-9_]+\b")
PLACEHOLDER = re.compile(r"\.\.\.|\[|\||<|\bSHAPE\b|\bPATH\b")  # inline usage lines: flags checked, not parsed


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _without_code(text: str) -> str:
    return FENCE.sub("", text)


def _code_blocks(text: str) -> Iterator[str]:
    """The shell lines of fenced blocks, with backslash continuations joined and comments dropped."""
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            yield line.split(" #")[0].strip()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def link_problems(doc: Path, text: str) -> list[str]:
    problems = []
    for match in LINK.finditer(_without_code(text)):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            problems.append(f"{doc.name}: link to a missing file: {target}")
            continue
        if anchor and path.suffix == ".md":
            anchors = {_slug(h) for h in HEADING.findall(_without_code(_text(path)))}
            if anchor not in anchors:
                problems.append(f"{doc.name}: no heading for #{anchor} in {path.name}")
    return problems


REPO_PATH = re.compile(r"(?:services|shared|kernels|pagoda|bench|tests|docs|deploy|docker)/[\w./-]*")


def path_problems(doc: Path, text: str) -> list[str]:
    """A repository path written in backticks (`services/worker/sampler.py`) names a file or folder that exists."""
    spans = set(INLINE.findall(text))
    return [f"{doc.name}: no such path: {span}" for span in sorted(spans)
            if REPO_PATH.fullmatch(span) and not (ROOT / span).exists()]


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", _text(ROOT / "Makefile"), re.M))


def make_problems(doc: Path, text: str, targets: set[str]) -> list[str]:
    spans = [*_code_blocks(text), *INLINE.findall(_without_code(text))]
    named = {t for span in spans for m in MAKE.finditer(span) for t in m.group(1).split()}
    return [f"{doc.name}: `make {t}` is not a Makefile target" for t in sorted(named - targets)]


def service_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `python -m pagoda.services.<name>` (shared/service_main.py, services/api/__main__.py)."""
    parser = argparse.ArgumentParser(prog=f"python -m pagoda.services.{name}", exit_on_error=False)
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """Follow subcommand words down the tree: the deepest parser and the words left for it."""
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


def _bench_options(module: str) -> set[str] | None:
    """The option strings a `python -m pagoda.bench.<module>` parser declares, read from its source (no import:
    benchmarks load torch). None when the module is not there."""
    path = ROOT / "bench" / f"{module.replace('.', '/')}.py"
    if not path.exists():
        return None
    tree = ast.parse(_text(path))
    options = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and n.value.startswith("--")}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    if calls & {"add_engine_args", "add_server_args"}:
        options |= set(service_parser("x")._option_string_actions)
    return options | {"-h", "--help"}


def command_problems(command: str, args: str, full: bool) -> list[str]:
    """`full`: a command from a code block, parsed whole; else an inline usage line: its words checked."""
    try:
        words = shlex.split(args.replace("&", " "))
    except ValueError as exc:
        if full:
            return [f"{command}{args}: {exc}"]
        words = args.replace('"', " ").split()  # an inline usage line cut at its placeholder
    if command == "pagoda":
        parser, rest = _subparser(build_parser(), words)
        if parser.prog == "pagoda":
            return [f"pagoda {args.strip()}: no such subcommand"]
    elif command.startswith("python") and ".services." in command:
        name = command.rsplit(".", 1)[1]
        if importlib.util.find_spec(f"pagoda.services.{name}.__main__") is None:
            return [f"{command}: no such service"]
        parser, rest = service_parser(name), words
    elif command.startswith("python") and ".bench" in command:
        module = command.split("pagoda.bench", 1)[1].lstrip(".") or "__main__"
        if module == "__main__":
            parser, rest = _subparser(build_parser(), ["bench", *words])
        else:
            options = _bench_options(module)
            if options is None:
                return [f"{command}: no such benchmark module"]
            unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in options]
            return [f"{command}: unknown option {u}" for u in unknown]
    else:
        module = command.split(" -m ", 1)[1]
        return [] if importlib.util.find_spec(module) is not None else [f"{command}: no such module"]
    if full:
        try:
            parser.exit_on_error = False
            parser.parse_args(rest)
        except (argparse.ArgumentError, SystemExit) as exc:
            return [f"{command} {args.strip()}: {exc}"]
        return []
    known = parser._option_string_actions
    return [f"{command} {args.strip()}: unknown option {w}" for w in rest
            if w.startswith("-") and w.split("=")[0] not in known]


def commands_in(text: str) -> Iterator[tuple[str, str, bool]]:
    lines = [part for line in _code_blocks(text) for part in re.split(r"&&|\|\||;|\|", line)]
    for line in (part.strip() for part in lines):
        match = COMMAND.search(line)
        if match and not line.startswith(("from ", "import ")):
            args, elided, _ = match.group(2).partition("...")  # `...` elides the rest: check the flags before it
            yield match.group(1), args, not elided
    for span in INLINE.findall(_without_code(text)):
        match = COMMAND.match(span)
        if match:
            args = PLACEHOLDER.split(match.group(2))[0]
            if args.strip() or not PLACEHOLDER.search(match.group(2)):  # `pagoda ...` names the CLI, no command
                yield match.group(1), args, False


def known_env_names() -> set[str]:
    """Settings (shared/config.py), the test hooks config.py and the tests read, and compose-level variables."""
    names = set(env_names())
    names |= {"PAGODA_" + n for n in re.findall(r'ENV_PREFIX \+ "(\w+)"', _text(ROOT / "shared/config.py"))}
    for test in (ROOT / "tests").rglob("*.py"):  # test hooks: read by the tests themselves
        names |= set(re.findall(r'environ(?:\.get\(|\[)"(PAGODA_\w+)"', _text(test)))
    names |= set(re.findall(r"\$\{(PAGODA_\w+)", _text(ROOT / "compose.yaml")))
    return names


def env_problems(doc: Path, text: str, known: set[str]) -> list[str]:
    return [f"{doc.name}: {name} is not a pagoda setting" for name in sorted(set(ENV.findall(text)) - known)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_point_to_files_and_headings(doc: Path) -> None:
    assert link_problems(doc, _text(doc)) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_exist(doc: Path) -> None:
    assert path_problems(doc, _text(doc)) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_make_targets_exist(doc: Path) -> None:
    assert make_problems(doc, _text(doc), make_targets()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_parse(doc: Path) -> None:
    problems = [p for cmd, args, full in commands_in(_text(doc)) for p in command_problems(cmd, args, full)]
    assert problems == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_environment_variables_are_settings(doc: Path) -> None:
    assert env_problems(doc, _text(doc), known_env_names()) == []


def test_the_quick_start_keeps_make_run_and_make_test() -> None:
    readme = _text(ROOT / "README.md")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make run" in quick and "make test" in quick
    assert {"run", "test"} <= make_targets()


def test_the_checks_catch_what_is_wrong(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    text = ("[gone](nowhere.md) [self](#no-such-heading)\n# Title\n`make no-such-target`\n"
            "```sh\npagoda serve --no-such-flag 1\npagoda no-such-command\n"
            "python -m pagoda.services.scheduler --max-num-seqs many\npagoda serve --no-such-flag ... --port 1\n"
            "true && pagoda serve --no-such-other-flag 1 | tail\n"
            "python -m pagoda.bench.no_such_bench\npython -m pagoda.bench.structured --no-such-option\n```\n"
            "`PAGODA_NO_SUCH_SETTING=1` `pagoda serve --port 1 --no-such [--x]`\n")
    doc.write_text(text)
    assert len(link_problems(doc, text)) == 2
    missing = "`services/worker/no_such.py`"
    assert path_problems(doc, text + missing) == ["bad.md: no such path: services/worker/no_such.py"]
    assert make_problems(doc, text, make_targets()) == ["bad.md: `make no-such-target` is not a Makefile target"]
    problems = [p for cmd, args, full in commands_in(text) for p in command_problems(cmd, args, full)]
    assert len(problems) == 8, problems
    assert env_problems(doc, text, known_env_names()) == ["bad.md: PAGODA_NO_SUCH_SETTING is not a pagoda setting"]
    good = ("```sh\nmake model && pagoda serve --port 9000 --max-num-seqs 8 | tee log\n"
            "python -m pagoda.services.worker --worker-rank 1\n```\n")
    assert [p for cmd, args, full in commands_in(good) for p in command_problems(cmd, args, full)] == []
