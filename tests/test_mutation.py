"""The mutation suite's mutants (ci/bench/mutation.py, run by ci/bench.sh),
the behaviour set and the merge set: each must still apply to the patched
tree, and say so loudly when it does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO.root / "ci" / "bench"))
import mutation  # noqa: E402


@pytest.mark.real_release
@pytest.mark.parametrize("mutant", mutation.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_the_patched_tree(mutant: mutation.Mutant) -> None:
    text = (REPO.tree / mutant.file).read_text()
    assert mutation.mutated(text, mutant) != text


@pytest.mark.real_release
@pytest.mark.parametrize("mutant", mutation.MERGE_MUTANTS, ids=lambda m: m.name)
def test_every_merge_mutant_applies_to_the_patched_tree(
    mutant: mutation.Mutant,
) -> None:
    text = (REPO.tree / mutant.file).read_text()
    assert mutation.mutated(text, mutant) != text


def test_the_merge_set_remakes_the_thirteen_breakages() -> None:
    """The eleven of the merge onto 0.34.0 and the two of issue 42's trial."""
    names = [m.name for m in mutation.MERGE_MUTANTS]
    assert len(names) == 13 and len(set(names)) == 13
    assert not set(names) & {m.name for m in mutation.MUTANTS}


def test_a_mutant_with_a_second_edit_needs_both_to_apply() -> None:
    mutant = mutation.Mutant("m", "what", "f.py", "a\n", "b\n", also=(("c\n", ""),))
    assert mutation.mutated("a\nc\n", mutant) == "b\n"
    with pytest.raises(mutation.MutantError, match="occurs 0 times"):
        mutation.mutated("a\n", mutant)


def test_static_findings_are_compared_without_their_lines() -> None:
    before = ["v.py:3:1: F401 `os` imported but unused"]
    after = [
        "v.py:9:1: F401 `os` imported but unused",
        "v.py:12:5: F821 Undefined name `config`",
    ]
    assert mutation.new_findings(before, after) == [after[1]]


def test_a_mutant_that_no_longer_applies_names_itself() -> None:
    mutant = mutation.MUTANTS[0]
    with pytest.raises(mutation.MutantError) as e:
        mutation.mutated("code a patch rewrote\n", mutant)
    assert str(e.value) == (
        f"mutant {mutant.name} no longer applies to {mutant.file} (its text occurs "
        "0 times, not once): update it in ci/bench/mutation.py"
    )


def test_a_python_that_is_not_a_file_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(SystemExit) as exit_info:
        mutation.main(
            [
                "--tree",
                str(tmp_path),
                "--python",
                str(missing),
                "--out",
                str(tmp_path / "x"),
            ]
        )
    assert exit_info.value.code == 2
    assert f"--python {missing} is not a file" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
