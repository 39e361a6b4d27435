"""--help: every field of the config with its type, default and description; `python -m grpo_recipe.train --help`
prints it and exits 0."""
import dataclasses
import subprocess
import sys

import pytest
from conftest import REPO

from grpo_recipe.config.help import help_text
from grpo_recipe.config.load import HelpRequested, parse_cli
from grpo_recipe.config.schema import Config
from grpo_recipe.dist.env import rank_env


def test_help_lists_every_field_with_type_default_and_description():
    with pytest.raises(HelpRequested):
        parse_cli(["--seed", "1", "-h"])
    text = help_text()
    for f in dataclasses.fields(Config):
        assert f"  --{f.name} (" in text, f.name
        assert f.metadata["help"] in text
    assert "  --learning_rate (float, default: 1.0e-06)" in text
    assert "  --dataset_config (str | null, default: null)" in text
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--help"], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == text and not proc.stderr.strip()


def test_the_configuration_reference_page_is_the_one_the_code_generates():
    """docs/configuration.md is generated from the dataclass: a field added, removed or redescribed without
    regenerating it fails here (python -m grpo_recipe.config.help --markdown > docs/configuration.md)."""
    from grpo_recipe.config.help import reference_markdown

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page.strip() == reference_markdown().strip()
    assert all(f"| `{f.name}` |" in page for f in dataclasses.fields(Config))
