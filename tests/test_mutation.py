"""The mutation suite's mutants (ci/bench/mutation.py, run by ci/bench.sh):
each must still apply to the patched tree, and say so loudly when it does not."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO.root / "ci" / "bench"))
import mutation  # noqa: E402


@pytest.mark.real_release
@pytest.mark.parametrize("mutant", mutation.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_the_patched_tree(mutant: mutation.Mutant) -> None:
    text = (REPO.tree / mutant.file).read_text()
    assert mutation.mutated(text, mutant) != text


def test_a_mutant_that_no_longer_applies_names_itself() -> None:
    mutant = mutation.MUTANTS[0]
    with pytest.raises(mutation.MutantError) as e:
        mutation.mutated("code a patch rewrote\n", mutant)
    assert str(e.value) == (
        f"mutant {mutant.name} no longer applies to {mutant.file} (its text occurs "
        "0 times, not once): update it in ci/bench/mutation.py"
    )
