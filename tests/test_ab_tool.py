"""tools/ab.py, the A/B of the working tree against an earlier commit: the order of
its runs, the filled-in command, and that each run imports the engram_jax of its
own tree's folder, even beside this environment's (editable) install. The builds
themselves are pip's; the runs here use folders made by hand (`--no-build`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import load_file

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "ab.py"
SCRIPT = """import sys
import engram_jax
print("ran", engram_jax.TREE, engram_jax.__file__, *sys.argv[1:])
sys.exit(int(engram_jax.TREE == "base" and "--fail-base" in sys.argv))
"""


def _trees(work: Path, trees: tuple[str, ...] = ("head", "base")) -> Path:
    """A folder per tree, each with a stand-in engram_jax that names its tree, and a
    script."""
    for tree in trees:
        package = work / tree / "engram_jax"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"TREE = {tree!r}\n")
    script = work / "show.py"
    script.write_text(SCRIPT)
    return script


def _ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120
    )


def test_runs_take_turns_each_with_its_trees_package(tmp_path):
    script = _trees(tmp_path)
    result = _ab("HEAD", "--no-build", "--workdir", str(tmp_path), "--rounds", "3", "--",
                 str(script), "--name", "ab_{tree}_{round}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    ran = [line.split() for line in result.stdout.splitlines() if line.startswith("ran ")]
    assert [(words[1], words[-1]) for words in ran] == [
        ("head", "ab_head_1"), ("base", "ab_base_1"),
        ("base", "ab_base_2"), ("head", "ab_head_2"),
        ("head", "ab_head_3"), ("base", "ab_base_3"),
    ]  # fmt: skip
    for words in ran:  # the stand-in of the run's own folder, not the installed package
        assert Path(words[2]) == tmp_path / words[1] / "engram_jax" / "__init__.py"
    imported = [line for line in result.stdout.splitlines() if line.startswith("engram_jax from")]
    assert len(imported) == 6


def test_further_trees_take_their_turns_too(tmp_path):
    """--tree adds a tree to every round, in the order given in odd rounds and the
    reverse in even ones; --no-build wants it built as the other two."""
    script = _trees(tmp_path, ("head", "base", "merge64", "fold"))
    trees = ["--tree", "merge64=unused", "--tree", "fold=unused"]
    result = _ab("HEAD", *trees, "--no-build", "--workdir", str(tmp_path), "--rounds", "2",
                 "--", str(script), "{tree}_{round}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    ran = [line.split() for line in result.stdout.splitlines() if line.startswith("ran ")]
    assert [words[-1] for words in ran] == [
        "head_1", "base_1", "merge64_1", "fold_1", "fold_2", "merge64_2", "base_2", "head_2"
    ]  # fmt: skip
    assert all(Path(words[2]).parent.name == "engram_jax" for words in ran)
    assert all(Path(words[2]).parent.parent.name == words[1] for words in ran)
    result = _ab("HEAD", "--tree", "other=x", "--no-build", "--workdir", str(tmp_path), "--",
                 str(script))  # fmt: skip
    assert result.returncode == 2 and "no engram_jax built" in result.stderr


@pytest.mark.parametrize(
    "spec, message",
    [("merge64", "give NAME=SOURCE"), ("a-b=x", "give NAME=SOURCE"), ("x=", "give NAME=SOURCE"),
     ("base=x", "base names another tree")],
)  # fmt: skip
def test_a_bad_further_tree_is_named(tmp_path, spec, message):
    result = _ab("HEAD", "--tree", spec, "--workdir", str(tmp_path / "w"), "--", "x.py")
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "w").exists()  # nothing built


def test_a_failing_run_fails_the_ab_after_all_runs(tmp_path):
    script = _trees(tmp_path)
    result = _ab("HEAD", "--no-build", "--workdir", str(tmp_path), "--", str(script), "--fail-base")
    assert result.returncode == 1
    assert "=== base round 1: exit status 1" in result.stdout
    assert "=== head round 1: exit status 0" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["HEAD", "--no-build", "--", "x.py"], "--no-build runs the trees of an earlier --workdir"),
        (["HEAD", "--no-build", "--workdir", "."], "give the command after --"),
        (["HEAD", "--rounds", "0", "--", "x.py"], "--rounds must be at least 1"),
    ],
)
def test_bad_invocations_say_what_is_wrong(args, message):
    result = _ab(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_no_build_needs_both_trees_built(tmp_path):
    (tmp_path / "head" / "engram_jax").mkdir(parents=True)
    result = _ab("HEAD", "--no-build", "--workdir", str(tmp_path), "--", "x.py")
    assert result.returncode == 2
    assert "no engram_jax built" in result.stderr and "base" in result.stderr


def test_a_base_that_is_no_commit_is_named(tmp_path):
    script = _trees(tmp_path / "unused")
    result = _ab("no-such-commit", "--workdir", str(tmp_path / "work"), "--", str(script))
    assert result.returncode == 2
    assert "no-such-commit:" in result.stderr
    assert not (tmp_path / "work" / "head").exists()  # nothing built


def test_a_base_folder_is_built_as_it_is(tmp_path):
    """A folder of the base's files is the base tree's sources (nothing exported); a
    folder that holds no source tree is named, and nothing is built."""
    ab = load_file("ab", TOOL)
    tree = tmp_path / "tree"
    tree.mkdir()
    assert ab.tree_sources(str(tree), tmp_path / "work")[0] is None
    (tree / "pyproject.toml").write_text("")
    assert ab.tree_sources(str(tree), tmp_path / "work") == (tree.resolve(), None)
    assert not (tmp_path / "work").exists()
    script = _trees(tmp_path / "unused")
    result = _ab(str(tmp_path / "unused"), "--workdir", str(tmp_path / "w"), "--", str(script))
    assert result.returncode == 2
    assert "no source tree (no pyproject.toml in it)" in result.stderr
    assert not (tmp_path / "w" / "head").exists()
