"""docs/cli.md is complete against `--help`: every subcommand and every long option the binary
offers (found by walking `cryptbridge --help` and each subcommand's `--help`, recursively) is
named in docs/cli.md, in the section for that command.

Sections are the `## ` headings. A heading names the commands in its backticked `cryptbridge ...`
spans (`cryptbridge file encrypt|decrypt` names `file encrypt` and `file decrypt`); a command's
section is the one naming it, or else the one naming its nearest parent (`luks dump` lives under
the heading that names `cryptbridge luks`). In a section of its own, an option may be anywhere in
the section; in a parent's section, it must be in the command's synopsis there (the indented
lines starting `cryptbridge luks add-key ...`), so one subcommand's options do not vouch for
another's. The top level (`cryptbridge --help`) maps to the sections that name no command.
Options that the top level offers to every subcommand (`--verbose`) are checked at the top
level only. Options are matched as whole tokens (`--key-size` does not match `--key-size-x`); a value list
(`[possible values: cpu, rtl-sim]`) must appear too. The README's synopsis of `serve` is checked
the same way.
"""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache

import pytest

from conftest import REPO, require_binary

CLI_MD = REPO / "docs" / "cli.md"
SKIP_OPTIONS = {"help"}  # every command has it; docs/cli.md says so once


def _help(path: tuple) -> str:
    p = subprocess.run([str(require_binary()), *path, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"cryptbridge {' '.join(path)} --help failed: {p.stderr}"
    return p.stdout


def parse_help(text: str) -> tuple[list, dict]:
    """(subcommands, {long option: [possible values]}) from one clap --help text."""
    subs, opts = [], {}
    section = None
    last = None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line[:-1]
            continue
        if section == "Commands":
            m = re.match(r"^  (\S+)", line)
            if m and m.group(1) != "help":
                subs.append(m.group(1))
        elif section == "Options":
            m = re.match(r"^  (?:-\w, |    )--([a-z0-9][\w-]*)", line)
            if m:
                last = m.group(1)
                opts.setdefault(last, [])
            if last is None:
                continue
            m = re.search(r"\[possible values: ([^\]]+)\]", line)
            if m:
                opts[last] += [v.strip() for v in m.group(1).split(",")]
            m = re.match(r"^\s+- ([\w-]+):", line)  # long help's "Possible values:" list
            if m:
                opts[last].append(m.group(1))
    return subs, opts


@lru_cache(maxsize=None)
def command_tree() -> dict:
    """{command path (tuple): (subcommands, options)} for the binary and every subcommand."""
    tree = {}
    todo = [()]
    while todo:
        path = todo.pop()
        subs, opts = parse_help(_help(path))
        tree[path] = (subs, opts)
        todo += [path + (s,) for s in subs]
    return tree


def heading_commands(heading: str) -> list:
    """Command paths a heading names: from each `cryptbridge w1 w2|w3 ...` span, the words up to
    the first option, placeholder or bracket; `a|b` gives both."""
    paths = []
    for span in re.findall(r"`cryptbridge ([^`]*)`", heading):
        prefixes = [()]
        for word in span.split():
            if not re.fullmatch(r"[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*", word):
                break
            prefixes = [p + (alt,) for p in prefixes for alt in word.split("|")]
        paths += [p for p in prefixes if p]
    return paths


def sections(text: str) -> list:
    """[(heading, command paths it names, body)] for each `## ` section; the text before the
    first heading belongs to the top level."""
    out = []
    parts = re.split(r"(?m)^## ", text)
    out.append(("(preamble)", [], parts[0]))
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        out.append((heading, heading_commands(heading), part))
    return out


def token_in(token: str, text: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(token) + r"(?![\w-])", text) is not None


def synopsis(section: str, path: tuple) -> str:
    """The synopsis lines of `path` in a parent's section: an indented line with `cryptbridge
    <path>` (or `a|b` naming it) and its more indented continuation lines."""
    lines = section.splitlines()
    found = []
    head = r"cryptbridge " + r"\s+".join(re.escape(w) for w in path[:-1])
    for i, line in enumerate(lines):
        m = re.match(r"^(\s+)" + head + r"\s+([a-z0-9|-]+)", line)
        if not m or path[-1] not in m.group(2).split("|"):
            continue
        indent = len(m.group(1))
        found.append(line)
        for nxt in lines[i + 1:]:
            if len(nxt) - len(nxt.lstrip()) > indent and nxt.strip():
                found.append(nxt)
            else:
                break
    return "\n".join(found)


def problems(doc: str, tree: dict) -> list:
    """Everything `--help` offers that `doc` (docs/cli.md's text) does not name where it should."""
    secs = sections(doc)
    out = []
    global_opts = set(tree[()][1])  # -v/--verbose: offered by every subcommand, documented once
    for path, (subs, opts) in sorted(tree.items()):
        name = "cryptbridge" + "".join(" " + w for w in path)
        if path:
            opts = {o: v for o, v in opts.items() if o not in global_opts}
        # The section(s) for this path: those naming it; for a command group such as `bench`,
        # those naming its subcommands; else the synopsis under its nearest named parent.
        if not path:
            own = [b for _, c, b in secs if not c]
        else:
            own = [body for _, cmds, body in secs if path in cmds] or \
                  [body for _, cmds, body in secs if subs and any(c[: len(path)] == path for c in cmds)]
        where, scope = own, "section"
        if not own:
            for k in range(len(path) - 1, 0, -1):
                parent = [body for _, cmds, body in secs if path[:k] in cmds]
                if parent:
                    where = [synopsis(b, path) for b in parent]
                    scope = f"synopsis under the `cryptbridge {' '.join(path[:k])}` section"
                    if not any(where):
                        out.append(f"`{name}`: no synopsis line `{name} ...` in the {scope[12:]}")
                    break
        if not where:
            out.append(f"`{name}`: no `## ` section names it (nor a parent command)")
            continue
        text = "\n".join(where)
        for s in subs:
            child = path + (s,)
            named = any(c[: len(child)] == child for _, cmds, _ in secs for c in cmds)
            if not named and not token_in(" ".join(child), doc):
                out.append(f"`{name} {s}`: subcommand not in docs/cli.md")
        for opt, values in opts.items():
            if opt in SKIP_OPTIONS:
                continue
            if not token_in("--" + opt, text):
                out.append(f"`{name} --{opt}`: not in its {scope}")
                continue
            for v in values:
                if not token_in(v, text):
                    out.append(f"`{name} --{opt} {v}`: value not in its {scope}")
    return out


def test_help_tree_is_parsed():
    """The parser finds what it must (so an empty result cannot pass the test below)."""
    tree = command_tree()
    for path in [(), ("serve",), ("luks",), ("luks", "format"), ("luks", "add-key"), ("file", "encrypt"),
                 ("file", "sweep"), ("bench", "cipher"), ("keygen",), ("cipher",)]:
        assert path in tree, f"cryptbridge {' '.join(path)} not found by walking --help: {sorted(tree)}"
    assert {"backing", "key-file", "max-inflight-bytes", "engine", "tls"} <= set(tree[("serve",)][1])
    assert tree[("serve",)][1]["engine"] == ["cpu", "rtl-sim"]
    assert "new-keyfile" in tree[("luks", "add-key")][1]
    assert {"verbose", "version"} <= set(tree[()][1])


def test_cli_md_names_every_command_and_option():
    found = problems(CLI_MD.read_text(), command_tree())
    assert not found, (f"docs/cli.md lacks {len(found)} thing(s) that `--help` offers "
                       "(add them to the command's section / synopsis):\n  " + "\n  ".join(found))


@pytest.mark.parametrize("token,path", [
    ("--new-keyfile", ("luks", "add-key")),
    ("--max-inflight-bytes", ("serve",)),
    ("--chunk-size", ("file", "encrypt")),
    ("--pbkdf-memory", ("luks", "change-key")),
    ("rtl-sim", ("serve",)),
])
def test_checker_catches_a_missing_option(token, path):
    """The check is real: with one option (or value) taken out of docs/cli.md, it fails, naming it."""
    doc = CLI_MD.read_text()
    assert token_in(token, doc), f"{token} should be in docs/cli.md"
    cut = re.sub(r"(?<![\w-])" + re.escape(token) + r"(?![\w-])", "--removed-for-the-test", doc)
    name = "cryptbridge " + " ".join(path)
    found = problems(cut, command_tree())
    assert any(f.startswith(f"`{name} ") and token.lstrip("-") in f for f in found), found


def test_readme_synopsis_has_every_serve_option():
    """The README's synopsis block lists every `serve` option too."""
    readme = (REPO / "README.md").read_text()
    m = re.search(r"Synopsis[^\n]*\n\n```\n(.*?)```", readme, re.S)
    assert m, "README.md: no Synopsis block"
    syn = m.group(1)
    tree = command_tree()
    missing = [o for o in tree[("serve",)][1]
               if o not in SKIP_OPTIONS and o not in tree[()][1] and not token_in("--" + o, syn)]
    assert not missing, f"README.md synopsis lacks serve options: {missing}"
