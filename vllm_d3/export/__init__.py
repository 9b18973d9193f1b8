"""The upstream patch series, generated from this package
(``vllm-d3 export-patches``; docs/upstream.md).

``series.SERIES`` lists the commits in a reviewer's order, each a ``Patch``:
its title, message, changes (``NewFile``: a module of this package written
whole at the upstream path it mirrors; ``TreeFile``: a file of vLLM's tree
outside ``vllm/``, a test, a docs page or a CI file, kept in ``tree/``;
``Diff``: a diff of vLLM's files in ``edits/``), the CPU tests it makes pass
in-tree and a control that fails on vLLM as released; ``series_tests`` are the
tests the series itself adds, in vLLM's layout. ``export_series`` commits them
over a vLLM repository and writes them with ``git format-patch``;
``patched_tree`` makes a runnable copy of the installed vLLM with them applied;
``in_tree_modules`` and ``in_tree_test_args`` serve the in-tree test run
(``tests/conftest.py``). A 0.33.x release whose lines moved under a diff stops
the export (``ExportError``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The package this module belongs to, and the one its modules mirror.
PACKAGE = "vllm_d3"
UPSTREAM = "vllm"
#: A plugin module's logger (with the comment that explains its name, if any).
_PLUGIN_LOGGER = re.compile(
    r'(# Under the "vllm" logger, .*\n)?logger = init_logger\(f"vllm\.\{__name__\}"\)'
)
#: Who the exported commits are by, unless git's environment says otherwise.
AUTHOR = ("vllm-d3", "vllm-d3@users.noreply.github.com")


class ExportError(RuntimeError):
    """The series does not apply to the given vLLM tree."""


@dataclass(frozen=True)
class NewFile:
    """A module of this package, written whole at its upstream path."""

    module: str
    """Its path inside this package, e.g. ``model_executor/models/d3.py``."""

    @property
    def path(self) -> str:
        return f"{UPSTREAM}/{self.module}"

    def text(self) -> str:
        source = (Path(__file__).parent.parent / self.module).read_text()
        source = re.sub(rf"\b{PACKAGE}\.", f"{UPSTREAM}.", source)
        source = re.sub(rf"\bimport {PACKAGE}\b", f"import {UPSTREAM}", source)
        return re.sub(_PLUGIN_LOGGER, "logger = init_logger(__name__)", source)


#: Where the series' diffs of vLLM's own files are kept.
EDITS = Path(__file__).parent / "edits"
#: Where the files the series adds outside ``vllm/`` are kept, at their paths.
TREE = Path(__file__).parent / "tree"


@dataclass(frozen=True)
class TreeFile:
    """A file the series adds outside ``vllm/`` (its tests, docs and CI), kept
    in ``TREE`` at its path in vLLM's tree and written as it is."""

    path: str

    def text(self) -> str:
        return (TREE / self.path).read_text()


@dataclass(frozen=True)
class Diff:
    """Changes to vLLM's files: ``EDITS/name``, a ``git diff`` against the tree
    the series' earlier commits leave on vLLM 0.33.0 (a file one of them added
    included)."""

    name: str

    @property
    def path(self) -> Path:
        return EDITS / self.name

    def files(self) -> list[str]:
        """The vLLM files it changes."""
        lines = self.path.read_text().splitlines()
        return [line.removeprefix("+++ b/") for line in lines if line[:6] == "+++ b/"]


@dataclass(frozen=True)
class Patch:
    """One commit of the series. Its changes apply in order to the tree the
    previous commits left: a ``NewFile`` with its ``vllm_d3`` imports and
    logger name read as vLLM's, less what a later commit's diff changes in it;
    a ``TreeFile`` as it is; a ``Diff`` of vLLM's own files, or of one an
    earlier commit added."""

    title: str
    body: str
    changes: tuple[NewFile | TreeFile | Diff, ...]
    tests: tuple[str, ...]
    """The CPU tests this commit makes pass in-tree, without the plugin (pytest
    arguments: files, or tests a ``--deselect`` of an earlier commit left out;
    a ``--deselect`` leaves out a test of a file here that a later commit
    needs)."""
    control: str | None
    """A test of ``tests`` that fails on vLLM as released, without the plugin
    (``None`` for a commit that changes no code: docs and CI)."""
    backports: tuple[str, ...] = ()
    """Modules of this package that give the plugin this commit's edits on vLLM
    as released, each at the path of the upstream file it stands for; in-tree
    that file is imported in its place (``in_tree_modules``)."""


def in_tree_test_args(patches: Sequence[Patch]) -> list[str]:
    """pytest arguments for the CPU tests of ``patches``, run on the tree they
    make: each file once, the tests they name outside those files, and the
    tests one leaves out that none of them names."""
    args = [arg for patch in patches for arg in patch.tests]
    named = {arg for arg in args if not arg.startswith("--")}
    files = [arg for arg in named if "::" not in arg]
    tests = [arg for arg in named if arg.split("::")[0] not in files]
    left_out = {
        arg
        for arg in args
        if arg.startswith("--deselect=")
        and arg.removeprefix("--deselect=") not in named
    }
    return sorted(files) + sorted(tests) + sorted(left_out)


def series_tests(patches: Sequence[Patch]) -> list[str]:
    """The test modules ``patches`` add to vLLM's ``tests/``."""
    return [
        change.path
        for patch in patches
        for change in patch.changes
        if isinstance(change, TreeFile)
        and change.path.startswith("tests/")
        and Path(change.path).name.startswith("test_")
    ]


def _module_name(package: str, module: str) -> str:
    return f"{package}.{module.removesuffix('.py').replace('/', '.')}"


def in_tree_modules() -> dict[str, str]:
    """Each module of this package that the series puts into vLLM (its new files
    and the backports of its edits), by the upstream module that is it in-tree.
    A NewFile's imports of these modules read as imports of those."""
    from .series import SERIES

    return {
        _module_name(PACKAGE, module): _module_name(UPSTREAM, module)
        for patch in SERIES
        for module in (
            *(c.module for c in patch.changes if isinstance(c, NewFile)),
            *patch.backports,
        )
    }


def _git(repo: Path, *args: str) -> str:
    # AUTHOR, where git's environment names nobody.
    name, email = AUTHOR
    env = {
        **{f"GIT_{who}_NAME": name for who in ("AUTHOR", "COMMITTER")},
        **{f"GIT_{who}_EMAIL": email for who in ("AUTHOR", "COMMITTER")},
        **os.environ,
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ExportError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def installed_vllm() -> Path:
    """The directory of the ``vllm`` package Python imports."""
    import vllm

    return Path(vllm.__file__).parent


def _base_repo(vllm_src: Path | None, repo: Path) -> None:
    """``repo``: vLLM at the series' base commit: a clone of a git checkout,
    the whole of another source tree (vLLM's source distribution: ``tests/``,
    ``docs/`` and ``.buildkite/`` included), or the installed package's Python
    files."""
    if vllm_src is not None and (vllm_src / ".git").exists():
        _git(vllm_src, "clone", "-q", "--shared", ".", str(repo.resolve()))
        return
    package = installed_vllm() if vllm_src is None else vllm_src / UPSTREAM
    if not (package / "__init__.py").is_file():
        raise ExportError(f"{package} is not a vllm package directory")
    if vllm_src is not None:
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(vllm_src, repo, ignore=skip, dirs_exist_ok=True)
        base = f"vLLM (the source tree {vllm_src.name})"
    else:
        for source in package.rglob("*.py"):
            if "__pycache__" in source.parts:
                continue
            target = repo / UPSTREAM / source.relative_to(package)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        base = "vLLM (the Python tree of the installed package)"
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", base)


def _text_as_added(new_file: NewFile | TreeFile, later: Sequence[Patch]) -> str:
    """``new_file``'s text as its commit adds it: its own, less what the
    ``later`` commits' diffs change in it."""
    text = new_file.text()
    diffs = [
        change
        for patch in later
        for change in patch.changes
        if isinstance(change, Diff) and new_file.path in change.files()
    ]
    if not diffs:
        return text
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target = work / new_file.path
        target.parent.mkdir(parents=True)
        target.write_text(text)
        _git(work, "init", "-q")
        for diff in reversed(diffs):
            _git(work, "apply", "-R", f"--include={new_file.path}", str(diff.path))
        return target.read_text()


def apply_patch(repo: Path, patch: Patch, later: Sequence[Patch] = ()) -> None:
    """Write ``patch``'s changes into ``repo`` and commit them (``later``: the
    series' commits after it, whose diffs may change a file it adds)."""
    for change in patch.changes:
        if isinstance(change, Diff):
            try:
                _git(repo, "apply", str(change.path))
            except ExportError as e:
                raise ExportError(
                    f"{change.name} does not apply to this vLLM tree (the series "
                    f"is written against vLLM 0.33.0): {e}"
                ) from e
            continue
        target = repo / change.path
        if target.exists():
            raise ExportError(f"{change.path}: already in this vLLM tree")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_text_as_added(change, later))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{patch.title}\n\n{patch.body}")


def export_series(out: Path, repo: Path, vllm_src: Path | None = None) -> list[Path]:
    """Commit the series in ``repo`` (a directory that does not exist yet) and
    write it to ``out``; returns the patch files."""
    from .series import SERIES

    repo.mkdir(parents=True)
    _base_repo(vllm_src, repo)
    base = _git(repo, "rev-parse", "HEAD").strip()
    for index, patch in enumerate(SERIES):
        apply_patch(repo, patch, SERIES[index + 1 :])
    out.mkdir(parents=True, exist_ok=True)
    written = _git(repo, "format-patch", "-o", str(out.resolve()), base)
    return [Path(line) for line in written.splitlines()]


def _series_commit(commits: int) -> str:
    """The revision after the first ``commits`` patches of the series."""
    from .series import SERIES

    return f"HEAD~{len(SERIES) - commits}"


def patched_tree(
    repo: Path, installed: Path, dst: Path, commits: int | None = None
) -> Path:
    """``dst/vllm``: the installed package, linked file by file, with the files
    the first ``commits`` patches (default: all) add or change, as ``repo``
    has them after those. Returns ``dst``."""
    from .series import SERIES

    base, rev = (
        _series_commit(0),
        _series_commit(len(SERIES) if commits is None else commits),
    )
    package = dst / UPSTREAM
    for directory, subdirs, files in os.walk(installed):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        here = package / Path(directory).relative_to(installed)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            (here / name).symlink_to(Path(directory) / name)
    for path in _git(repo, "diff", "--name-only", base, rev).split():
        target = dst / path
        target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_git(repo, "show", f"{rev}:{path}"))
    return dst
