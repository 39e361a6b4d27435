"""The documentation: docs/ builds with MkDocs in strict mode (a broken link or anchor, or a page left out of the
navigation, fails), the README stays a short guide whose links resolve, and the tracked tree stays small."""
import re
import subprocess
import sys

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
