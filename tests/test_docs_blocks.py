"""bench/docs_blocks.py: every figure block in README.md, docs/ and bench/README.md is what its results file gives,
and the check fails on a wrong figure in a scratch copy (a test of the test)."""
import shutil
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from docs_blocks import BLOCK, BLOCKS, differing, pages  # noqa: E402

RESULTS = REPO / "bench" / "results"


def test_every_block_is_its_results_files():
    assert differing(REPO, RESULTS) == [], "rerun python bench/docs_blocks.py"
    used = {m.group(2) for page in pages(REPO) for m in BLOCK.finditer(page.read_text())}
    assert used == set(BLOCKS), f"blocks without a page: {set(BLOCKS) - used}"


def scratch(tmp_path):
    for name in ("README.md", "docs", "bench/README.md"):
        src, dst = REPO / name, tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    shutil.copytree(RESULTS, tmp_path / "results", ignore=shutil.ignore_patterns("tmp", "*.png"))
    return tmp_path


def test_a_wrong_figure_in_a_page_or_a_changed_results_file_is_caught(tmp_path):
    root = scratch(tmp_path)
    page = root / "docs" / "scaling.md"
    text = page.read_text()
    page.write_text(text.replace("(0.18x)", "(0.13x)", 1))
    assert differing(root, root / "results") == ["docs/scaling.md: lora-memory-table"]
    page.write_text(text)
    lora = root / "results" / "lora_vllm.json"
    lora.write_text(lora.read_text().replace('"peak_rss_mib_per_rank": 6983.115234375', '"peak_rss_mib_per_rank": 9600'))
    assert sorted(differing(root, root / "results")) == ["bench/README.md: lora-vllm-table",
                                                         "docs/scaling.md: lora-vllm-peaks"]


def test_a_changed_results_file_is_caught_on_every_page_that_holds_its_block(tmp_path):
    root = scratch(tmp_path)
    sep = root / "results" / "separate_generation.json"
    sep.write_text(sep.read_text().replace('"wait_s": 0.0032429670027340762', '"wait_s": 0.0132429670027340762', 1))
    assert sorted(differing(root, root / "results")) == ["bench/README.md: separate-overlap",
                                                         "bench/README.md: separate-table",
                                                         "docs/benchmarks.md: separate-overlap",
                                                         "docs/scaling.md: separate-overlap"]


@pytest.mark.parametrize("page,typed,wrong,block", [
    ("bench/README.md", "**2.90x** the fp32 model", "**2.89x** the fp32 model", "scale-table"),
    ("docs/scaling.md", "| 2 | policy | **2.90x** (5.3 GiB) |", "| 2 | policy | **2.89x** (5.3 GiB) |",
     "whole-run-table"),
    ("docs/scaling.md", "| 1.00 / 1.28 | 1.00 / 1.00 |", "| 1.00 / 1.28 | 1.00 / 1.01 |", "scale-startup-table"),
], ids=["bench_readme_scale", "scaling_whole_run", "scaling_startup"])
def test_a_figure_typed_wrong_in_a_generated_table_is_caught(tmp_path, page, typed, wrong, block):
    """Each figure as it was typed by hand before its table was generated (scale.json: 2.896 and 1.005)."""
    root = scratch(tmp_path)
    path = root / page
    text = path.read_text()
    assert text.count(typed) == 1
    path.write_text(text.replace(typed, wrong))
    assert differing(root, root / "results") == [f"{page}: {block}"]
