"""The suite under pytest-xdist (the README's `-n 2`): a test file is one unit of
work, and every file that makes node-shared tables or looks in /dev/shm is in
conftest.py's one unit of such files, so no two workers see each other's files
there."""

from pathlib import Path

from . import conftest

# What a file that makes shared tables or reads /dev/shm names.
SHM_WORDS = ("NodeGroup", "SHM_DIR", "/dev/shm")


def test_every_file_that_touches_dev_shm_is_in_the_shm_unit():
    here = Path(__file__)
    touching = {
        path.name
        for path in here.parent.glob("test_*.py")
        if path != here and any(word in path.read_text() for word in SHM_WORDS)
    }
    assert touching == conftest.SHM_FILES


def test_a_test_is_scheduled_with_its_file():
    unit = conftest.scheduling_unit
    assert unit("tests/test_layout.py::test_x[a@b]") == "tests/test_layout.py"
    assert unit("tests/test_layout.py::Case::test_y") == "tests/test_layout.py"
    assert unit("tests/test_storage.py::test_x") == unit("tests/test_examples.py::test_y") == "shm"
