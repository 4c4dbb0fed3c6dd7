"""Renders BENCHMARKS.md's table of current figures and the README's headline figures from the one file that holds
every figure, docs/benchmarks/figures.toml, so a figure is written in one place.

    python -m benchmarks.figures            # exit status 1 and the names of the stale files if a section differs
    python -m benchmarks.figures --write    # rewrite the sections between the markers

Each rendered section sits between `<!-- figures: NAME -->` and `<!-- figures: end -->` lines; the rest of each
file is written by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "benchmarks" / "figures.toml"
STATUSES = ("current", "superseded")
END = "<!-- figures: end -->"


@dataclasses.dataclass(frozen=True)
class Figure:
    id: str
    metric: str
    value: str
    baseline: str
    ratio: str
    date: str
    commit: str
    command: str
    device: str
    entry: str
    status: str
    superseded_by: str = ""
    readme: bool = False

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"figure {self.id}: status {self.status!r}, not one of {STATUSES}")
        if not re.fullmatch(r"docs/benchmarks/\w+\.md#[\w-]+", self.entry):
            raise ValueError(f"figure {self.id}: entry {self.entry!r} is not docs/benchmarks/FILE.md#anchor")

    @property
    def notebook(self) -> str:
        """The entry's notebook as the tables name it: docs/benchmarks/expert_parallel.md -> 'expert parallel'."""
        return pathlib.Path(self.entry.partition("#")[0]).stem.replace("_", " ")


def load(path: pathlib.Path = DATA) -> list[Figure]:
    figures = [Figure(**fields) for fields in tomllib.loads(path.read_text())["figure"]]
    ids = [f.id for f in figures]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    missing = sorted({f.superseded_by for f in figures if f.superseded_by} - set(ids))
    if repeated or missing:
        raise ValueError(f"{path}: ids repeated {repeated}, superseded_by naming no figure {missing}")
    return figures


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _link(figure: Figure, relative_to: str) -> str:
    return f"[{figure.notebook}]({relative_to}{figure.entry})"


def current_table(figures: list[Figure]) -> str:
    """BENCHMARKS.md's table: every current figure, in the data's order; a command the row above has too is
    written 'as above'."""
    lines = [
        "| metric | ours | baseline, same run | ratio | date | commit | command | entry |",
        "|---|---|---|---|---|---|---|---|",
    ]
    above = None
    for f in figures:
        if f.status != "current":
            continue
        command = "as above" if f.command == above else f.command
        above = f.command
        cells = (f.metric, f.value, f.baseline, f.ratio, f.date, f.commit, command, _link(f, ""))
        lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    return "\n".join(lines)


def readme_table(figures: list[Figure]) -> str:
    """The README's headline figures: the current figures marked readme, without date, commit and command."""
    lines = ["| metric | ours | baseline, same run | ratio | entry |", "|---|---|---|---|---|"]
    for f in figures:
        if f.status == "current" and f.readme:
            cells = (f.metric, f.value, f.baseline, f.ratio, _link(f, ""))
            lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    return "\n".join(lines)


SECTIONS = {ROOT / "BENCHMARKS.md": ("current", current_table), ROOT / "README.md": ("headline", readme_table)}


def rendered(text: str, name: str, body: str) -> str:
    """text with the lines between `<!-- figures: name -->` and the next `<!-- figures: end -->` replaced by body."""
    begin = f"<!-- figures: {name} -->"
    pattern = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(END)}$", re.MULTILINE | re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one section between {begin!r} and {END!r}")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{END}", text)


def stale_files(figures: list[Figure], *, write: bool) -> list[pathlib.Path]:
    """The files whose rendered section differs from the data's; with write, rewritten."""
    stale = []
    for path, (name, render) in SECTIONS.items():
        text = path.read_text()
        new = rendered(text, name, render(figures))
        if new != text:
            stale.append(path)
            if write:
                path.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the rendered sections")
    args = parser.parse_args(argv)
    stale = stale_files(load(), write=args.write)
    what = "rewritten" if args.write else f"differs from {DATA.relative_to(ROOT)}"
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {what}")
    return 0 if args.write or not stale else 1


if __name__ == "__main__":
    sys.exit(main())
