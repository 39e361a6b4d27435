"""The documentation: docs/ builds with MkDocs in strict mode (a broken link or anchor, or a page left out of the
navigation, fails), the README stays a short guide whose links resolve, and the tracked tree stays small."""
import re
import subprocess
import sys

import pytest
from conftest import REPO


def test_docs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "configuration/index.html", "reliability/index.html"} <= built


def test_readme_is_a_short_guide_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first = [ln for ln in readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines() if ln.strip()]
    assert [ln.split("#")[0].strip() for ln in first] == ["bash launch/quickstart.sh", "bash tests/run.sh"]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_the_tracked_tree_is_small_and_carries_no_third_party_packages():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    sizes = {f.decode(): (REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).exists()}
    assert sum(sizes.values()) < 10 * 2**20, f"tracked tree {sum(sizes.values()) / 2**20:.1f} MiB"
    big = {f: s for f, s in sizes.items() if s > 2 * 2**20}
    assert not big, f"tracked files over 2 MiB: {big}"
    assert not [f for f in sizes if f.endswith((".whl", ".tar.gz", ".zip"))]


def test_every_test_a_page_names_as_holding_a_promise_exists():
    """docs/ and README name the tests that hold each promise (`test_x.py::test_name`): each must be a test
    function of that file, so a renamed or deleted test cannot leave a promise pointing at nothing."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for file, name in re.findall(r"`?(test_\w+\.py)::(test_\w+)", page.read_text()):
            path = REPO / "tests" / file
            if not path.is_file() or not re.search(rf"^def {name}\(", path.read_text(), re.MULTILINE):
                missing.append(f"{page.name}: {file}::{name}")
    assert not missing, "named tests that do not exist:\n" + "\n".join(missing)


# How prose states a field's default: `field` defaults to V; (`field: V`, the default); `field: N`, V by default;
# `field: x` (an option; the default is V); `field` is `V` (TRL: ...), the TRL-differences table's form.
DEFAULT_PATTERNS = (r"`(\w+)` defaults? to `?([\w.+\-]+)`?",
                    r"\(`(\w+): ([\w.+\-]+)`, the default\)",
                    r"`(\w+): N`, ([\w.+\-]+) by default",
                    r"`(\w+): \w+` \(an option; the default is (?:mu = )?([\w.+\-]+?)[,)]",
                    r"`(\w+)` is `([\w.+\-]+)` \(TRL: ")
STATING_DEFAULTS = ("README.md", "docs/*.md", "bench/README.md", "grpo_recipe/configs/*.yaml")


def stated_defaults(text: str) -> list[tuple[str, str]]:
    return [m for pattern in DEFAULT_PATTERNS for m in re.findall(pattern, " ".join(text.split()))]


def wrong_defaults(root) -> list[str]:
    """Every default the prose states for a config field that is not the field's default in config/schema.py."""
    from dataclasses import fields

    from grpo_recipe.config.schema import Config

    defaults = {f.name: str(f.default).lower() for f in fields(Config) if isinstance(f.default, (int, float, str, bool))}
    wrong = []
    for pattern in STATING_DEFAULTS:
        for page in sorted(root.glob(pattern)):
            if page.name == "findings-reuse-default.md":  # a history: what was the default when
                continue
            for field, value in stated_defaults(page.read_text()):
                if field in defaults and value.lower() != defaults[field]:
                    wrong.append(f"{page.relative_to(root)}: {field} stated as {value}, config/schema.py has "
                                 f"{defaults[field]}")
    return wrong


def test_every_default_the_prose_states_is_the_schemas():
    assert stated_defaults("Until then, `num_iterations` defaults to 1, as in TRL. (`max_staleness: 0`, the "
                           "default) and `num_iterations: auto` (an option; the default is mu = 1)") == [
        ("num_iterations", "1"), ("max_staleness", "0"), ("num_iterations", "1")]
    assert wrong_defaults(REPO) == []


def test_the_defaults_check_fails_on_a_wrong_default_in_a_scratch_copy(tmp_path):
    """A test of the test: the README's default of num_iterations changed to 4 in a copy is caught."""
    import shutil

    for name in ("README.md", "docs", "bench/README.md", "grpo_recipe/configs"):
        src, dst = REPO / name, tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("the default is mu = 1", "the default is mu = 4"))
    assert wrong_defaults(tmp_path) == ["README.md: num_iterations stated as 4, config/schema.py has 1"]


def test_the_readmes_reward_snippet_is_the_shipped_examples_code():
    """The snippet is the example file's own functions (the README's once called .strip() on chat completions)."""
    readme = (REPO / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "def format_reward" in b)
    assert snippet.strip() in (REPO / "grpo_recipe" / "examples" / "gsm_rewards.py").read_text()


@pytest.mark.slow
def test_the_trl_walk_through_runs_as_written_in_smoke_size(tmp_path):
    """docs/from-trl.md: its config (TRL's names) and its first command, with fewer steps and shorter completions."""
    from grpo_recipe.dist.env import rank_env
    from grpo_recipe.run.metrics import read_jsonl

    page = (REPO / "docs" / "from-trl.md").read_text()
    config = re.search(r"```yaml\n# trl_gsm8k.yaml\n(.*?)```", page, re.DOTALL).group(1)
    (tmp_path / "trl_gsm8k.yaml").write_text(config)
    command = re.search(r"```bash\n(.*?)\s+#", page, re.DOTALL).group(1).split()
    assert command == ["bash", "launch/local.sh", "--config", "trl_gsm8k.yaml"]
    out = tmp_path / "out"
    proc = subprocess.run([command[0], str(REPO / command[1]), *command[2:], "--max_steps", "2", "--max_completion_length",
                           "16", "--output_dir", str(out)], cwd=tmp_path, env=rank_env(VENV_PY=sys.executable),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note (TRL config): reward_weights: -> each reward_funcs entry's weight" in proc.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and "reward/format_reward" in records[0]
