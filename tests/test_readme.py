"""The README: a newcomer's page that opens with the two set-up commands, and whose every measured figure is
the figure of the page it links to (a regenerated page cannot leave a stale figure behind)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

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


def table_cell(page: str, heading: str, row: str, column: str) -> str:
    """The cell of a markdown table: the first table after ``heading`` on ``page``, its ``row``'s ``column``."""
    text = (ROOT / page).read_text().split(heading, 1)[1]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == row:
            return cells[header.index(column)]
    raise AssertionError(f"no row {row!r} under {heading!r} in {page}")


def megabytes(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"KB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def test_the_summary_states_what_goes_against_slamb():
    """The headline gives the figures that go against SLAMB beside those for it, from their pages: 1-bit LAMB's
    time to accuracy and its bytes in both in-kind studies, the paper's claim, and the ledger's whole-run ratio at
    the paper's shapes. A regenerated page that turns a comparison around fails here, as a stale figure does."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    verdict = (ROOT / "results" / "time_to_accuracy.md").read_text()
    slamb, onebit = (re.search(rf"{name} reaches the target in ([\d.]+)x LAMB's time", verdict)[1]
                     for name in ("SLAMB", "1-bit LAMB"))
    assert float(onebit) < float(slamb)  # what "1-bit LAMB reaches it sooner" says
    assert f"SLAMB reaches LAMB's accuracy in {slamb}x LAMB's time" in readme
    assert f"1-bit LAMB reaches it sooner, in {onebit}x LAMB's time" in readme
    study = "results/study/README.md"
    for heading, slamb_row, where in (("### study_digits_resnet8", "SLAMB v1", "On the digits it sent {} against "
                                       "SLAMB's {}"), ("### study_bert\n", "SLAMB", "On the tiny BERT it sent {} "
                                                       "against {}")):
        theirs, ours = (table_cell(study, heading, row, "bytes sent / worker") for row in ("1-bit LAMB", slamb_row))
        assert megabytes(theirs) < megabytes(ours)  # "1-bit LAMB sent fewer bytes per worker than SLAMB"
        assert where.format(theirs, ours) in readme
    assert "The paper claims that SLAMB sends half of 1-bit LAMB's data" in readme
    whole_run = "## BERT-Large phase 1, whole run"
    fp16, fp32 = (table_cell("results/comm_volume.md", whole_run, f"SLAMB {dtype} (k=0.1, H=100)", "vs 1-bit LAMB")
                  for dtype in ("fp16", "fp32"))
    assert f"SLAMB sends {fp16}x 1-bit LAMB's bytes with fp16 momentum, and {fp32}x with fp32" in readme


def test_the_readme_links_the_paper_the_authors_code_and_the_citation():
    readme = (ROOT / "README.md").read_text()
    assert "(https://openreview.net/pdf?id=cMmjBH5LqW)" in readme
    assert "(https://github.com/hangxu0304/SLAMB)" in readme
    assert "[`CITATION.cff`](CITATION.cff)" in readme and "[`LICENSE`](LICENSE)" in readme


def test_the_license_file_and_the_citation_match_the_package():
    import tomllib

    import yaml

    license_ = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert (ROOT / "LICENSE").read_text().splitlines()[0] == f"{license_} License"
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == license_ and cff["authors"]
    paper = cff["preferred-citation"]
    assert paper["title"] == "SLAMB: Accelerated Large Batch Training with Sparse Communication"
    assert [a["family-names"] for a in paper["authors"]] == ["Xu", "Zhang", "Fei", "Wu", "Xie", "Huang", "Xie",
                                                              "Elhoseiny", "Kalnis"]
    assert paper["year"] == 2023 and paper["repository-code"] == "https://github.com/hangxu0304/SLAMB"


# the pages a newcomer reads first, and the study's
FIRST_PAGES = ["README.md", "docs/reproduce.md", "docs/recipes.md", "docs/configs.md", "docs/study.md"]


def test_no_paragraph_of_the_first_pages_starts_mid_sentence():
    for page in FIRST_PAGES:
        text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
        for block in re.split(r"\n\s*\n", text):
            block = block.strip()
            assert not block or not block[0].islower(), f"{page}: {block[:80]}"


def test_the_docs_cite_files_that_exist():
    """docs/recipes.md named config files and a specification that the repository does not hold (its ``.py``
    names outside this repository's folders, ``main.py``, ``Cifar10/main.py``, are the reference code's)."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    for name in re.findall(r"`([\w./*{},-]+\.(?:yaml|md|py))`", text):
        if name.endswith(".py") and not (ROOT / name.split("/")[0]).is_dir():
            continue
        names = [name.replace(m[0], part) for m in re.findall(r"(\{([^}]*)\})", name)[:1]
                 for part in m[1].split(",")] or [name]
        for one in names:
            assert any(list(base.glob(one)) for base in (ROOT, ROOT / "docs", ROOT / "configs")), one


def test_the_configs_page_shows_no_made_up_run():
    text = (ROOT / "docs" / "configs.md").read_text()
    assert not re.search(r"final_test_top1=\d", text) and "Renamed in this layout" not in text


def test_the_study_docs_give_the_steps_the_page_ran():
    page = (ROOT / "results" / "study" / "README.md").read_text()
    steps = re.search(r"length: 40 epochs \((\d+) steps\)", page)[1]
    assert f"of 40 epochs ({steps} steps)" in (ROOT / "docs" / "study.md").read_text()
    assert f"the run's {steps} steps" in (ROOT / "configs" / "experiment" / "study" / "digits_onebit_lamb.yaml").read_text()


# a page, or a run's record kept with one, names no folder of the machine that made it
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|root|Users|mnt|scratch|tmp)/")


def test_results_pages_and_kept_records_name_no_machine_folder():
    from bench import shown_command

    texts = [p for p in (ROOT / "results").rglob("*") if p.is_file() and p.suffix in (".md", ".json", ".jsonl",
                                                                                        ".yaml", ".csv")]
    assert len(texts) > 100  # the pages and the study's kept runs
    assert not [str(p.relative_to(ROOT)) for p in texts if MACHINE_PATH.search(p.read_text())]
    assert shown_command(["--workdir", str(ROOT / "runs" / "tta"), f"data.dir={ROOT / 'runs' / 'd'}",
                          "hydra.run.dir=/scratch/u/x", "seed=0", "/"]) == \
        "--workdir runs/tta data.dir=runs/d hydra.run.dir=.../x seed=0 /"


def test_a_kept_record_shows_its_paths_without_the_machine_folders(tmp_path):
    from harness.records import keep_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"command": [str(ROOT / "cifar10" / "train.py"), "seed=1",
                                                           f"data.dir={ROOT / 'runs' / 'data'}"],
                                               "note": "1,500 train / 297 test", "top1": 97.31649831649831}))
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dir": "/scratch/u/digits", "micro_batch": 64}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n" + '{"step": 2, "lo')
    for name in ("meta.json", "config.yaml", "metrics.jsonl"):
        keep_record(run / name, tmp_path / name)
    assert json.loads((tmp_path / "meta.json").read_text()) == {
        "command": ["cifar10/train.py", "seed=1", "data.dir=runs/data"], "note": "1,500 train / 297 test",
        "top1": 97.31649831649831}
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"data": {"dir": ".../digits", "micro_batch": 64}}
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.1}\n{"step": 2, "lo\n'


def test_contributing_names_no_tool_the_repository_does_not_ship():
    assert "duplicates --change" not in (ROOT / "CONTRIBUTING.md").read_text()
