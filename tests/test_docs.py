"""Every code block of the docs site and of the README runs, or is checked as what it shows.

A fenced block's language says how it is tested:

- ``python``: the python blocks of a page run in order as one script (a block
  sees the names of the blocks above it, as a reader does), in a fresh
  process, in a temporary folder that holds links to ``configs/`` and
  ``examples/``;
- ``bash``: the block runs in bash in such a folder, each ``dpmp train``
  shortened to two steps; a block of ``make`` lines is checked with
  ``make -n`` (each target exists and expands), a block of ``pip install``
  lines against ``pyproject.toml`` (the project and the extras it names);
- ``sh``: a shell template that cannot run on one machine (several hosts):
  each ``dpmp`` command in it is checked against that command's ``--help``;
- ``text``: output, a synopsis or a figure: its ``dpmp`` command lines are
  checked against ``--help``, its policy strings must round-trip through
  ``dpmp.Policy``, and a tree of ``dpmp/`` must name folders and files that
  exist;
- ``toml``: a config, which ``dpmp.load_config`` must accept.
"""

import functools
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
KINDS = {"python", "bash", "sh", "text", "toml"}
BIN = Path(sys.executable).parent

# Pages whose python blocks take more than ~10 s (they train): the slow suite.
SLOW_PYTHON = {
    "docs/quickstart.md",  # the same step (15-40 s)
    "docs/own-model.md",  # trains the default config through dpmp.train (~30 s)
    "docs/language-models.md",  # trains a tiny language model through dpmp.train (~15 s)
    "docs/precision.md",  # compiles and audits several steps (~7 s)
    "docs/architecture.md",  # registers variants and builds a step (~4 s)
}
# What `dpmp train` in a bash block runs instead of its config's full length.
SHORT_RUN = "dpmp train --set training.steps=2 --set training.eval_every=0 --set pretrain.steps=2"
SLOW_BASH = re.compile(r"\bdpmp train\b")  # any training run takes more than ~10 s


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _cases(kind: str) -> list:
    cases = []
    for page in PAGES:
        for i, (lang, code) in enumerate(_blocks(page)):
            if lang == kind:
                cases.append(pytest.param(page, code, id=f"{_name(page)}#{i}"))
    return cases


def _workdir(tmp_path: Path) -> Path:
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_every_block_declares_a_kind_that_is_checked():
    unknown = [
        f"{_name(page)}: ```{lang or '(none)'}"
        for page in PAGES
        for lang, _ in _blocks(page)
        if lang not in KINDS
    ]
    assert not unknown, f"blocks whose language says nothing about how to test them: {unknown}"


# Columns a code block shows without scrolling at 1280 px (the site's table of contents is in
# the left sidebar, mkdocs.yml's toc.integrate); right-hand comments past it were hidden.
CODE_COLUMNS = 100


def test_code_blocks_fit_the_page():
    wide = [
        f"{_name(page)}: {len(line)} columns: {line[:60]}..."
        for page in PAGES
        for _, code in _blocks(page)
        for line in code.splitlines()
        if len(line) > CODE_COLUMNS
    ]
    assert not wide, "\n".join(wide)


def test_the_readme_is_a_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "make test" in text  # CI runs the README's test command
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


# -- python -------------------------------------------------------------------------------------


def _python_pages() -> list:
    params = []
    for page in PAGES:
        if page.name == "README.md":  # tests/test_readme.py runs it and checks what it prints
            continue
        code = [c for lang, c in _blocks(page) if lang == "python"]
        if code:
            marks = [pytest.mark.slow] if _name(page) in SLOW_PYTHON else []
            params.append(pytest.param(page, "\n".join(code), id=_name(page), marks=marks))
    return params


@pytest.mark.parametrize(("page", "code"), _python_pages())
def test_python_blocks_run(page, code, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_workdir(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"{_name(page)}:\n{out.stderr[-4000:]}"


# -- bash ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _bash_cases() -> list:
    params = []
    for p in _cases("bash"):
        page, code = p.values
        slow = any(SLOW_BASH.search(command) for command in _commands(code))
        params.append(pytest.param(page, code, id=p.id, marks=[pytest.mark.slow] if slow else []))
    return params


def _commands(code: str) -> list[str]:
    """The block's command lines: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = [line.split(" #", 1)[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize(("page", "code"), _bash_cases())
def test_bash_blocks_run(page, code, tmp_path):
    commands = _commands(code)
    if all(c.startswith("pip install ") for c in commands):
        _check_pip_installs(commands)
        return
    if all(c.startswith("make ") for c in commands):
        for command in commands:
            target = shlex.split(command)[1]
            out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
            assert out.returncode == 0, f"{command}: {out.stderr}"
        return
    script = SLOW_BASH.sub(SHORT_RUN, code).replace(":8476", f":{_free_port()}")
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=_workdir(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"{_name(page)}:\n{script}\n{out.stderr[-4000:]}"
    for run_dir in re.findall(r"--out (\S+)", code):
        assert (tmp_path / run_dir / "report.json").is_file(), run_dir


def _check_pip_installs(commands: list[str]) -> None:
    """``pip install .`` or ``.[extra,...]`` (``-e`` allowed): this checkout's project, with
    extras that its pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for command in commands:
        for arg in shlex.split(command)[2:]:
            if arg == "-e":
                continue
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            assert m, f"`{command}`: installs {arg!r}, not this checkout"
            extras = m.group(1).split(",") if m.group(1) else []
            unknown = [e for e in extras if e not in project.get("optional-dependencies", {})]
            assert not unknown, f"`{command}`: pyproject.toml has no extra {unknown}"


# -- sh and text --------------------------------------------------------------------------------


@functools.cache
def _help(command: str) -> str:
    args = [str(BIN / "dpmp"), *([command] if command else []), "--help"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _dpmp_lines(code: str) -> list[str]:
    return [c for c in _commands(code) if c.startswith("dpmp ") or c == "dpmp"]


def _shown_cases() -> list:
    return [p for p in _cases("sh") + _cases("text") if _checks(p.values[1])]


def _checks(code: str) -> bool:
    return bool(_dpmp_lines(code) or _policies(code) or code.startswith("dpmp/"))


def _policies(code: str) -> list[str]:
    return re.findall(r"\bparam=\w+(?:,\w+=\w+)+", code)


@pytest.mark.parametrize(("page", "code"), _shown_cases())
def test_shown_blocks_are_true(page, code):
    import dpmp

    for line in _dpmp_lines(code):
        words = line.split()
        command = words[1] if len(words) > 1 and not words[1].startswith("-") else ""
        text = _help(command)
        options = re.findall(r"(?<![\w-])--[a-z][\w-]*", line)
        missing = [o for o in options if o not in text]
        assert not missing, f"{_name(page)}: `{line}`: not in `dpmp {command} --help`: {missing}"
    for policy in _policies(code):
        assert str(dpmp.Policy.parse(policy)) == policy
    if code.startswith("dpmp/"):
        for entry in re.findall(r"^  (\S+)", code, re.M):
            assert (ROOT / "dpmp" / entry).exists(), f"{_name(page)}: dpmp/{entry} does not exist"


# -- toml ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("page", "code"), _cases("toml"))
def test_toml_blocks_are_configs(page, code, tmp_path):
    import dpmp

    path = tmp_path / "config.toml"
    path.write_text(code)
    loaded = dpmp.load_config(path).to_dict()
    for section, table in tomllib.loads(code).items():
        if section == "policy":
            assert loaded["policy"] == str(dpmp.Policy.parse(table))
            continue
        for key, value in table.items():  # every key the block sets is the config's
            assert loaded[section][key] == value, f"{section}.{key}"


# -- the API reference --------------------------------------------------------------------------

LAYERS = ("accounting", "precision", "noise", "clipping", "audit", "data", "models", "step")


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_has_a_generated_reference_page(layer):
    page = DOCS / "api" / f"{layer}.md"
    assert f"::: dpmp.{layer}\n" in page.read_text()


def test_every_top_level_name_is_in_the_reference():
    import dpmp

    text = (DOCS / "api" / "dpmp.md").read_text()
    missing = [name for name in dpmp.__all__ if f"dpmp.{name}`" not in text]
    assert not missing, f"docs/api/dpmp.md does not list {missing}"
