"""The shipped GSM8K-shaped parquet file is what its script writes, in GSM8K's shape."""
import pytest

pytest.importorskip("reasoning_gym")
from grpo_recipe.rewards.math_answers import reference_answer  # noqa: E402
from grpo_recipe.tools.make_gsm8k_like import DEFAULT_OUT, rows, write  # noqa: E402


def test_shipped_file_is_the_scripts_output(tmp_path):
    import datasets

    shipped = datasets.load_dataset("parquet", data_files=str(DEFAULT_OUT), split="train").to_list()
    assert shipped == rows(300, 0)
    assert len(shipped) >= 250 and set(shipped[0]) == {"question", "answer"}
    for row in shipped:  # a worked solution ending in GSM8K's marker, which math_accuracy reads
        assert row["answer"].splitlines()[-1].startswith("#### ")
        assert float(reference_answer(row["answer"]).replace(",", "")) == float(row["answer"].rsplit("#### ", 1)[1])
    assert write(tmp_path / "g.parquet", 10, 1) == len(rows(10, 1))
