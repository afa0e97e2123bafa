"""The documentation as reference: pages short enough to read, links that lead somewhere, and the
strategy trait table generated from the classes (like docs/configuration.md)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_PAGE_LINES, MAX_README_LINES = 250, 150


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_docs_page_is_at_most_250_lines(page):
    n = _lines(page)
    assert n <= MAX_PAGE_LINES, (
        f"docs/{page.name} has {n} lines (at most {MAX_PAGE_LINES}): keep what is true now and move dated "
        "findings, ablations and per-seed tables to bench_results/*.md, linked from a short 'Results' section"
    )


def test_readme_is_at_most_150_lines():
    n = _lines(ROOT / "README.md")
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): it is the front page"


def _relative_links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # not inside code blocks
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
            yield target.partition("#")[0]


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_in_the_repository(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_link_check_sees_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](other.md#a) [web](https://example.com) [self](#b)\n```\n[code](nowhere.md)\n```\n")
    assert list(_relative_links(page)) == ["other.md"]


def _documented_traits() -> str:
    from torchacco.parallel.registry import TRAITS_BEGIN, TRAITS_END

    text = (ROOT / "docs" / "parallelism.md").read_text(encoding="utf-8")
    assert text.count(TRAITS_BEGIN) == 1 and text.count(TRAITS_END) == 1, "docs/parallelism.md lost its trait markers"
    return text.split(TRAITS_BEGIN)[1].split(TRAITS_END)[0].strip("\n") + "\n"


def test_the_trait_table_in_parallelism_md_is_the_one_generated_from_the_strategy_classes():
    from torchacco.parallel.registry import traits_table

    assert _documented_traits() == traits_table(), (
        "docs/parallelism.md's trait table is out of date: put the output of "
        "`python -m torchacco.parallel.registry` between its traits markers"
    )


def test_the_trait_table_follows_a_class_trait():
    from torchacco.parallel.registry import STRATEGIES, traits_table

    built_in = {n: c for n, c in STRATEGIES.items() if c.__module__.startswith("torchacco.parallel.")}
    assert traits_table(built_in) == traits_table()
    changed = type("ZeRO1Changed", (STRATEGIES["zero1"],), {"overlapped": True})
    assert traits_table({**built_in, "zero1": changed}) != traits_table(built_in)
