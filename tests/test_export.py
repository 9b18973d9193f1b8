"""The upstream patch series (``vllm-d3 export-patches``) against the installed
vLLM 0.33.0: exported, applied with ``git am`` and run in-tree with this plugin
not loaded (``VLLM_PLUGINS=""``, vLLM's allow-list of plugin names)."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from vllm_d3.cli import main
from vllm_d3.export import (
    Diff,
    ExportError,
    NewFile,
    Patch,
    TreeFile,
    apply_patch,
    export_series,
    in_tree_modules,
    in_tree_test_args,
    installed_vllm,
    patched_tree,
    series_tests,
)
from vllm_d3.export.series import CONTRACT, SERIES
from vllm_d3.testing.vllm_own_tests import SDIST_WORK, fetch_sdist

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The series through the command line, and a patched copy of vLLM."""
    work = tmp_path_factory.mktemp("export")
    out, tree = work / "patches", work / "tree"
    args = ["export-patches", "--out", str(out), "--patched-tree", str(tree)]
    assert main(args) == 0
    return sorted(out.glob("*.patch")), tree


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def base_repo(path: Path) -> Path:
    """A git repository of the installed vLLM's Python files, written here."""
    installed = installed_vllm()
    for source in installed.rglob("*.py"):
        if "__pycache__" not in source.parts:
            target = path / "vllm" / source.relative_to(installed)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return path


def test_one_patch_per_commit_in_order_and_git_am_applies_them(exported, tmp_path):
    patches, _ = exported
    subjects = [p.read_text().split("Subject: [PATCH", 1)[1] for p in patches]
    assert len(patches) == len(SERIES)
    for subject, patch in zip(subjects, SERIES, strict=True):
        assert subject.split("] ", 1)[1].startswith(patch.title[:40])
    repo = base_repo(tmp_path / "vllm-src")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "am", *map(str, patches))
    assert len(git(repo, "log", "--format=%s").splitlines()) == len(SERIES) + 1


def test_a_git_checkout_is_cloned_and_left_as_it_was(exported, tmp_path):
    patches, _ = exported
    src = base_repo(tmp_path / "checkout")
    (src / "NOTES").write_text("a commit after the release\n")
    git(src, "add", "NOTES")
    git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "notes")
    head = git(src, "rev-parse", "HEAD")
    out, tree = tmp_path / "patches", tmp_path / "tree"
    args = ["export-patches", "--out", str(out), "--vllm-src", str(src)]
    assert main([*args, "--patched-tree", str(tree)]) == 0
    # The same changes as from the installed package's files.
    diffs = [p.read_text().split("\n---\n", 1)[1] for p in sorted(out.glob("*"))]
    assert diffs == [p.read_text().split("\n---\n", 1)[1] for p in patches]
    assert git(src, "rev-parse", "HEAD") == head
    assert git(src, "status", "--porcelain") == ""
    # Only the series' files are copied into the patched tree.
    assert not (tree / "NOTES").exists()
    assert (tree / "vllm" / "__init__.py").is_symlink()


def test_the_series_applies_to_vllms_source_distribution(exported, tmp_path):
    # vLLM 0.33.0's sdist holds its whole tree: the series exports onto it and
    # git am applies it there, its tests, docs and CI files left as they are.
    patches, _ = exported
    sdist = fetch_sdist(ROOT / SDIST_WORK)
    out = tmp_path / "patches"
    args = ["export-patches", "--out", str(out), "--vllm-src", str(sdist)]
    assert main(args) == 0
    diffs = [p.read_text().split("\n---\n", 1)[1] for p in sorted(out.glob("*"))]
    assert diffs == [p.read_text().split("\n---\n", 1)[1] for p in patches]
    repo = tmp_path / "vllm-src"
    shutil.copytree(sdist, repo)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    files = set(git(repo, "ls-files").splitlines())
    assert {
        ".buildkite/test-pipeline.yaml",
        "tests/conftest.py",
        "docs/README.md",
    } <= files
    git(
        repo,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "am",
        *map(str, sorted(out.glob("*"))),
    )
    assert len(git(repo, "log", "--format=%s").splitlines()) == len(SERIES) + 1


def test_a_source_without_vllm_is_refused(tmp_path, capsys):
    args = ["export-patches", "--out", str(tmp_path / "out")]
    assert main([*args, "--vllm-src", str(tmp_path)]) == 1
    assert "is not a vllm package directory" in capsys.readouterr().err


def test_new_files_are_whole_modules_read_as_upstream():
    text = NewFile("model_executor/models/d3_contract.py").text()
    own = (ROOT / "vllm_d3/model_executor/models/d3_contract.py").read_text()
    assert "vllm_d3" not in text
    assert "logger = init_logger(__name__)" in text
    assert "logger = init_logger(__name__)" not in own
    assert text.count("\n") == own.count("\n") - 1  # the logger's comment


def test_new_files_import_only_what_the_series_puts_in_vllm():
    # A NewFile's package imports become vllm imports: each must name a module
    # the series adds, or one whose edits the plugin backports.
    in_tree = in_tree_modules()
    for patch in SERIES:
        for change in patch.changes:
            if not isinstance(change, NewFile):
                continue
            source = (ROOT / "vllm_d3" / change.module).read_text()
            for name in re.findall(r"^from (vllm_d3\.\S+) import", source, re.M):
                assert name in in_tree, f"{change.module} imports {name}"
    assert in_tree["vllm_d3.v1.worker.gpu.model_states.mamba_hybrid"] == (
        "vllm.v1.worker.gpu.model_states.mamba_hybrid"
    )


def test_a_diff_that_does_not_apply_stops_the_export_naming_it(tmp_path):
    repo = base_repo(tmp_path)
    config = repo / "vllm/model_executor/models/config.py"
    # A release that reworded a line the diff changes.
    line = 'attention_mode = decision.get("attention_mode", "causal")'
    assert line in config.read_text()
    config.write_text(config.read_text().replace(line, 'attention_mode = "causal"'))
    with pytest.raises(ExportError, match="01-contract.diff does not apply") as error:
        apply_patch(repo, CONTRACT)
    assert "vllm/model_executor/models/config.py" in str(error.value)


def diffs() -> list[Diff]:
    return [c for patch in SERIES for c in patch.changes if isinstance(c, Diff)]


def test_each_diff_changes_vllms_files_or_an_earlier_commits():
    installed = installed_vllm()
    added: set[str] = set()
    assert diffs()
    for patch in SERIES:
        for change in patch.changes:
            if isinstance(change, (NewFile, TreeFile)):
                added.add(change.path)
                continue
            text = change.path.read_text()
            assert "new file mode" not in text and "deleted file mode" not in text
            assert change.files()
            for path in change.files():
                own = (installed / path.removeprefix("vllm/")).is_file()
                assert own or path in added, path


def test_a_file_a_later_diff_changes_is_added_as_it_was_before(series_repo):
    # The contract module as the first commit adds it refuses prefix caching;
    # the state cache's commit lifts that, leaving the module's own text.
    path = "vllm/model_executor/models/d3_contract.py"
    first = git(series_repo, "show", f"HEAD~{len(SERIES) - 1}:{path}")
    last = git(series_repo, "show", f"HEAD:{path}")
    assert "do not support prefix caching yet" in first
    assert last == NewFile("model_executor/models/d3_contract.py").text()
    assert "prefix caching yet" not in last


def test_a_test_left_for_a_later_commit_runs_once_that_commit_is_in():
    first = Patch("a", "", (), ("t/a.py", "t/b.py", "--deselect=t/b.py::x"), "")
    later = Patch("b", "", (), ("t/c.py", "t/b.py::x", "t/d.py::y"), "")
    assert in_tree_test_args([first]) == ["t/a.py", "t/b.py", "--deselect=t/b.py::x"]
    assert in_tree_test_args([first, later]) == [
        "t/a.py",
        "t/b.py",
        "t/c.py",
        "t/d.py::y",
    ]


def test_a_new_file_that_exists_is_refused(tmp_path):
    repo = base_repo(tmp_path)
    patch = Patch("t", "b", (NewFile("config/__init__.py"),), (), "")
    with pytest.raises(ExportError, match="vllm/config/__init__.py: already"):
        apply_patch(repo, patch)


def test_the_patched_tree_links_all_but_the_series_files(exported):
    _, tree = exported
    installed = installed_vllm()
    init = tree / "vllm" / "__init__.py"
    assert init.is_symlink() and init.resolve() == (installed / "__init__.py")
    for path in (
        "model_executor/models/config.py",
        "model_executor/models/d3_contract.py",
    ):
        assert not (tree / "vllm" / path).is_symlink()
    assert (tree / "vllm/model_executor/models/config.py").read_text() != (
        installed / "model_executor/models/config.py"
    ).read_text()


PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs")
PROBE = """
import vllm, vllm_d3.registration
from vllm.plugins import load_general_plugins
load_general_plugins()
print(vllm.__file__, vllm_d3.registration.installed_hooks())
"""


def in_tree(
    tree: Path | None, *args: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """``python args`` in ``cwd`` with the patched vLLM (or the installed one)
    first on the path and no vLLM plugin allowed."""
    env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_D3_IN_TREE": "1"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tree), env.get("PYTHONPATH")])
        )
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_the_cpu_tests_pass_in_tree_without_the_plugin(exported):
    _, tree = exported
    probe = in_tree(tree, "-c", PROBE)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [str(tree / "vllm" / "__init__.py"), "[]"]
    run = in_tree(tree, *PYTEST, *in_tree_test_args(SERIES))
    assert run.returncode == 0, run.stdout[-3000:]
    # Only the tests of how the plugin reaches vLLM (and GPU tests) are skipped.
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("not loaded in-tree" in line for line in skipped)
    reasons = ("not loaded in-tree", "needs a CUDA GPU")
    assert all(any(reason in line for reason in reasons) for line in skipped)


@pytest.fixture(scope="module")
def series_repo(tmp_path_factory):
    """The repository the series is committed in."""
    work = tmp_path_factory.mktemp("series")
    export_series(work / "patches", work / "repo")
    return work / "repo"


def ruff_findings(source: str, path: str) -> Counter:
    """This package's ruff rules on ``source`` (as ``path``): each finding's code
    and message, line numbers left out."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format",
         "json", "--config", str(ROOT / "pyproject.toml"),
         "--stdin-filename", path, "-"],
        input=source, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr
    return Counter((f["code"], f["message"]) for f in json.loads(run.stdout))


@pytest.mark.parametrize("index", range(len(SERIES)))
def test_each_commits_diff_adds_no_lint_finding(series_repo, index):
    commit = f"HEAD~{len(SERIES) - 1 - index}"
    for change in SERIES[index].changes:
        if not isinstance(change, Diff):
            continue
        for path in change.files():
            before = git(series_repo, "show", f"{commit}~1:{path}")
            after = git(series_repo, "show", f"{commit}:{path}")
            assert after != before
            added = ruff_findings(after, path) - ruff_findings(before, path)
            assert not added, f"{change.name} adds to {path}: {dict(added)}"


@pytest.mark.parametrize(
    "index", [i for i, patch in enumerate(SERIES) if patch.control is not None]
)
def test_each_commits_control_fails_without_it(series_repo, tmp_path, index):
    # The tree with the commits before this one, no plugin: its control test
    # fails there (in the test, not its set-up), and passes in the run above.
    patch = SERIES[index]
    tree = tmp_path / "tree"
    before = patched_tree(series_repo, installed_vllm(), tree, commits=index)
    assert patch.control is not None
    run = in_tree(before, *PYTEST, patch.control)
    assert run.returncode == 1, run.stdout[-3000:]
    summary = [
        line.split(" ", 1)[1]
        for line in run.stdout.splitlines()
        if line.startswith("FAILED ")
    ]
    assert any(test.startswith(patch.control) for test in summary)


@pytest.mark.parametrize(
    "index", [i for i, patch in enumerate(SERIES) if series_tests([patch])]
)
def test_the_series_own_tests_pass_after_each_commit(series_repo, tmp_path, index):
    # Bisectable: after each commit that adds tests, its tests and those of the
    # commits before it pass on the tree it leaves, with no plugin loaded.
    tree = patched_tree(series_repo, installed_vllm(), tmp_path, commits=index + 1)
    tests = series_tests(SERIES[: index + 1])
    # From the tree's root, as vLLM runs its tests (its ``tests`` package).
    run = in_tree(tree, *PYTEST, *tests, cwd=tree)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
