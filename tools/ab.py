"""An A/B of the working tree against an earlier commit on one machine: both trees
built (pip, not editable) into folders of their own, side by side, then the same
command run with each tree's engram_jax in turns (head, base, then base, head, ...),
so that a benchmark's figures of the two trees come from one machine and one sitting.
The working tree is built as it is, its uncommitted changes too. BASE may be a folder
holding the earlier tree's files instead of a commit (`git archive BASE | tar -x -C DIR`
on a machine that has the history), for a machine that has only the working tree.

  python tools/ab.py f7ad705 --rounds 2 -- benchmarks/train.py --parts updates \
      --log2-batches 14 --name ab_{tree}_{round}

`--tree NAME=SOURCE` (a commit or a folder, as BASE) adds a further tree, built and
run in turn beside the two, so that one sitting compares several candidates:

  python tools/ab.py f7ad705 --tree merge64=/tmp/merge64 -- benchmarks/train.py ...

`{tree}` (head, base or a further tree's name) and `{round}` (1, 2, ...) in the
command are filled in for each run. The command is a Python script and its
arguments, run by this interpreter with the tree's folder first on sys.path and an
editable install's import hook set aside, so that every `import engram_jax` of the
script gets the tree's; each run prints the engram_jax it imported.
"""

from __future__ import annotations

import argparse
import io
import runpy
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("head", "base")
# scikit-build-core's editable install puts a finder first on sys.meta_path (its
# redirect mode): it would answer `import engram_jax` before sys.path is searched.
EDITABLE_FINDER = "ScikitBuild"
RUN_WITH = "--run-with"  # the child's form: python tools/ab.py --run-with DIR SCRIPT ARGS...


def run_order(rounds: int, trees: tuple[str, ...] = TREES) -> list[tuple[str, int]]:
    """(tree, round) for each run: the trees in their order in odd rounds, in reverse
    in even ones, so that no tree always runs first (or last) on a machine that
    drifts over a sitting."""
    order = []
    for number in range(1, rounds + 1):
        turn = trees if number % 2 else trees[::-1]
        order += [(tree, number) for tree in turn]
    return order


def fill_in(command: list[str], tree: str, number: int) -> list[str]:
    return [arg.replace("{tree}", tree).replace("{round}", str(number)) for arg in command]


def run_with(folder: str, script: str, args: list[str]) -> None:
    """Runs `script` as __main__ with the engram_jax installed in `folder`."""
    sys.meta_path[:] = [f for f in sys.meta_path if EDITABLE_FINDER not in type(f).__name__]
    sys.path[:0] = [str(Path(script).resolve().parent), folder]
    sys.argv = [script, *args]
    import engram_jax

    print(f"engram_jax from {engram_jax.__file__}", flush=True)
    runpy.run_path(script, run_name="__main__")


def export_commit(commit: str, dest: Path) -> str | None:
    """The commit's files (git archive) under `dest`; git's complaint if it has none."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True
    )
    if archive.returncode != 0:
        return archive.stderr.decode(errors="replace").strip()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return None


def tree_sources(source: str, work: Path, tree: str = "base") -> tuple[Path | None, str | None]:
    """Where a tree's sources are: `source` itself when it is a folder holding a source
    tree (an unpacked `git archive`, for a machine without the repository's history),
    else the commit's files exported under work/<tree>-src; or why neither."""
    folder = Path(source)
    if folder.is_dir():
        if not (folder / "pyproject.toml").is_file():
            return None, "a folder, but no source tree (no pyproject.toml in it)"
        return folder.resolve(), None
    complaint = export_commit(source, work / f"{tree}-src")
    return (None, complaint) if complaint else (work / f"{tree}-src", None)


def further_trees(specs: list[str]) -> tuple[dict[str, str], str | None]:
    """--tree NAME=SOURCE options as {name: source}; or what is wrong with one."""
    trees: dict[str, str] = {}
    for spec in specs:
        name, _, source = spec.partition("=")
        if not name.isidentifier() or not source:
            return {}, f"--tree {spec}: give NAME=SOURCE, NAME a word (letters, digits, _)"
        if name in TREES or name in trees:
            return {}, f"--tree {spec}: {name} names another tree"
        trees[name] = source
    return trees, None


def build(tree: str, sources: Path, work: Path, settings: list[str]) -> subprocess.Popen:
    """pip's build of `sources`, installed into work/<tree>, started; its CMake build in
    work/build-<tree> (away from an editable install's), its output in work/build-<tree>.log."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
               "--target", str(work / tree), str(sources)]  # fmt: skip
    settings = [f"build-dir={work / f'build-{tree}'}", *settings]
    command += [f"--config-settings={setting}" for setting in settings]
    with (work / f"build-{tree}.log").open("w") as log:  # the child keeps its own copy
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == RUN_WITH:
        run_with(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "base", help="the commit to compare the working tree with, or a folder of its files"
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree (1)")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=SOURCE",
        help="a further tree to build and run in turn: a commit or a folder, as BASE",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="where the trees are built (a new temp dir)")
    parser.add_argument(
        "--no-build", action="store_true",
        help="run with the trees an earlier invocation built in --workdir",
    )  # fmt: skip
    parser.add_argument(
        "--config-setting", action="append", default=[], metavar="KEY=VALUE",
        help="passed to both builds (pip's --config-settings), e.g. cmake.define.ENGRAM_CUDA=OFF",
    )  # fmt: skip
    parser.usage = "%(prog)s BASE [options] -- SCRIPT [ARGS...]"
    # Everything after the first `--` is the command, its options too.
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("give the command after --: a Python script and its arguments")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.no_build and args.workdir is None:
        parser.error("--no-build runs the trees of an earlier --workdir: give it")
    further, complaint = further_trees(args.tree)
    if complaint:
        parser.error(complaint)
    trees = (*TREES, *further)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="engram-ab-"))
    if args.no_build:
        missing = [tree for tree in trees if not (work / tree / "engram_jax").is_dir()]
        if missing:
            parser.error(f"--no-build: no engram_jax built in {work} for {', '.join(missing)}")
    else:
        work.mkdir(parents=True, exist_ok=True)
        sources: dict[str, Path | None] = {"head": ROOT}
        for tree, source in {"base": args.base, **further}.items():
            sources[tree], complaint = tree_sources(source, work, tree)
            if complaint:
                parser.error(f"{source}: {complaint}")
        builds = {tree: build(tree, sources[tree], work, args.config_setting) for tree in trees}
        failed = [tree for tree, process in builds.items() if process.wait() != 0]
        for tree in failed:
            print(f"{tree}: the build failed: {work / f'build-{tree}.log'}", file=sys.stderr)
        if failed:
            return 1
    status = 0
    for tree, number in run_order(args.rounds, trees):
        argv = fill_in(command, tree, number)
        print(f"=== {tree} round {number}: {' '.join(argv)}", flush=True)
        child = [sys.executable, str(Path(__file__).resolve()), RUN_WITH, str(work / tree), *argv]
        returncode = subprocess.run(child).returncode
        print(f"=== {tree} round {number}: exit status {returncode}", flush=True)
        status = status or returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
