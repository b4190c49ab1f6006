"""The README: a newcomer's page that opens with the two set-up commands, and whose every measured figure is
the figure of the page it links to (a regenerated page cannot leave a stale figure behind)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?![\w.])|\b[0-9a-f]{7,40}\b")


def units(text: str) -> list[str]:
    """The README's paragraphs and table rows: the units a figure and its page's link share."""
    out = []
    for block in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", text, flags=re.S)):
        lines = block.splitlines()
        out.extend(lines if lines and lines[0].startswith("|") else [" ".join(lines)])
    return out


def figures_and_pages(unit: str) -> tuple[list[str], list[Path]]:
    pages = [ROOT / target.split("#")[0] for _, target in LINK.findall(unit)
             if target.startswith("results/") and target.split("#")[0].endswith(".md")]
    # a link's text and target, and code, are names, not figures; so is a table row's first cell (the status
    # table's paper experiment: "ResNet-110" is the paper's model, not a figure of the page)
    if unit.startswith("|"):
        unit = "|".join(unit.split("|")[2:])
    prose = re.sub(r"`[^`]*`", " ", LINK.sub(" ", unit))
    return FIGURE.findall(prose), pages


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert len(text.splitlines()) <= 220


def test_every_figure_the_readme_quotes_is_on_the_page_it_links():
    checked = 0
    for unit in units((ROOT / "README.md").read_text()):
        figures, pages = figures_and_pages(unit)
        if not pages:
            continue
        text = " ".join(p.read_text() for p in pages)
        missing = [f for f in figures if not re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", text)]
        assert not missing, f"README figures {missing} are not on {[str(p.relative_to(ROOT)) for p in pages]}: {unit}"
        checked += len(figures)
    assert checked >= 20  # the status table and the study's figures


def test_the_figure_check_catches_a_stale_figure():
    # a figure that differs from its page's (the page regenerated since) is caught, a name or link is not
    unit = ("SLAMB is 0.12 points below LAMB ([study](results/study/README.md), `torch 2.11`, "
            "[`results/study/study_digits_resnet8.md`](results/study/study_digits_resnet8.md))")
    figures, pages = figures_and_pages(unit)
    assert figures == ["0.12"] and len(pages) == 2
    assert "0.12 points" not in " ".join(p.read_text() for p in pages)


def test_every_link_of_the_readme_resolves():
    for _, target in LINK.findall((ROOT / "README.md").read_text()):
        if not target.startswith(("http://", "https://", "#")):
            assert (ROOT / target.split("#")[0]).exists(), target
