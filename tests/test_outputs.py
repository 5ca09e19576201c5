"""Where results are written (specsample.outputs): refused before a run, made at its end."""

from __future__ import annotations

import pytest

from specsample.outputs import check_output_dir, check_output_file, write_text


def test_a_file_under_directories_not_made_yet_is_written(tmp_path):
    path = check_output_file(str(tmp_path / "a" / "b" / "results.json"), "--json")
    write_text(path, "{}")
    assert path.read_text() == "{}"
    assert check_output_dir(str(tmp_path / "new" / "run"), "--out") == tmp_path / "new" / "run"


@pytest.mark.parametrize("check", [check_output_dir, check_output_file])
def test_an_empty_path_is_not_the_current_directory(check):
    with pytest.raises(ValueError, match="--x is empty: name a path"):
        check("", "--x")
