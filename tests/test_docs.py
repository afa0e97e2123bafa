"""The documentation as reference: pages short enough to read and a whole short enough to read in an
evening, links (and their #anchors) that lead somewhere, and the strategy trait table generated from
the classes (like docs/configuration.md)."""

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
RESULTS = sorted((ROOT / "bench_results").glob("*.md"))
MAX_PAGE_LINES, MAX_DOCS_LINES, MAX_README_LINES = 250, 1900, 150
MOVE_FINDINGS = (
    "move dated findings, ablations and per-seed tables to bench_results/*.md, linked from a 'Results' section"
)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_docs_page_is_at_most_250_lines(page):
    n = _lines(page)
    assert n <= MAX_PAGE_LINES, f"docs/{page.name} has {n} lines (at most {MAX_PAGE_LINES}): {MOVE_FINDINGS}"


def test_the_docs_are_at_most_1900_lines_in_all():
    n = sum(_lines(p) for p in PAGES)
    assert n <= MAX_DOCS_LINES, (
        f"docs/ has {n} lines in all (at most {MAX_DOCS_LINES}): cut repetition, or {MOVE_FINDINGS}"
    )


def test_readme_is_at_most_150_lines():
    n = _lines(ROOT / "README.md")
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): it is the front page"


def _prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # not inside code blocks


def _relative_links(path: Path):
    """(file, anchor) of each link that is not a URL; file is "" for a link within the page."""
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):
            file, _, anchor = target.partition("#")
            yield file, anchor


def _anchors(path: Path) -> Iterator[str]:
    """The #anchors of a markdown page's headings, as GitHub makes them (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(path), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug + (f"-{seen[slug]}" if seen[slug] else "")


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES, *RESULTS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_and_heading_in_the_repository(page):
    missing = []
    for file, anchor in _relative_links(page):
        target = (page.parent / file) if file else page
        if not target.exists():
            missing.append(file)
        elif anchor and target.suffix == ".md" and anchor not in set(_anchors(target)):
            missing.append(f"{file}#{anchor}")
    assert not missing, f"{page.relative_to(ROOT)} links to files or headings that do not exist: {missing}"


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "## Modes (`[acco] mode`)\n## Modes (`[acco] mode`)\n"
        "[here](other.md#a) [web](https://example.com) [self](#b)\n```\n# not a heading\n[code](nowhere.md)\n```\n"
    )
    assert list(_relative_links(page)) == [("other.md", "a"), ("", "b")]
    assert list(_anchors(page)) == ["modes-acco-mode", "modes-acco-mode-1"]


def _documented_traits() -> str:
    from torchacco.parallel.registry import TRAITS_BEGIN, TRAITS_END

    text = (ROOT / "docs" / "parallelism.md").read_text(encoding="utf-8")
    assert text.count(TRAITS_BEGIN) == 1 and text.count(TRAITS_END) == 1, "docs/parallelism.md lost its trait markers"
    return text.split(TRAITS_BEGIN)[1].split(TRAITS_END)[0].strip("\n") + "\n"


def test_the_trait_table_in_parallelism_md_is_the_one_generated_from_the_strategy_classes():
    from torchacco.parallel.registry import traits_table

    assert _documented_traits() == traits_table(), (
        "docs/parallelism.md's trait table is out of date: put the output of "
        "`python -m torchacco traits` between its traits markers"
    )


def test_the_trait_table_follows_a_class_trait():
    from torchacco.parallel.registry import BUILT_IN, strategy_class, traits_table

    built_in = [strategy_class(name).traits for name in BUILT_IN]
    assert traits_table(built_in) == traits_table()
    changed = [dataclasses.replace(t, overlapped=True) if t.name == "zero1" else t for t in built_in]
    assert traits_table(changed) != traits_table(built_in)
