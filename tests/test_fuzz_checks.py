"""tools/fuzz_layouts.py's excuse for a later loss's drift: summation order's, as one process's
own at another micro_batch, and nothing more."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fuzz_layouts", Path(__file__).resolve().parents[1] / "tools" / "fuzz_layouts.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

REF = ([5.0, 4.8, 4.6], None, None)


def run(losses):
    return (losses, None, None)


def test_matching_losses_need_no_excuse():
    assert fuzz.later_loss_drift(run([5.0, 4.8 + 1e-6, 4.6]), REF, lambda: None) is None


def test_a_later_drift_one_process_shares_is_excused():
    note = fuzz.later_loss_drift(run([5.0, 4.8, 4.6 + 7e-5]), REF, lambda: run([5.0, 4.8, 4.6 - 7e-5]))
    assert note.startswith("losses drift 7")


@pytest.mark.parametrize("losses, other", [
    ([5.0 + 1e-4, 4.8, 4.6], run([5.0 + 1e-4, 4.8, 4.6])),  # the first step: no update to drift from
    ([5.0, 4.8, 4.6 + 1e-3], run([5.0, 4.8, 4.6 + 1e-5])),  # far past one process's own drift
    ([5.0, 4.8, 4.6 + 1e-4], None),  # global_batch 1: nothing to compare with
])
def test_other_misses_are_not(losses, other):
    with pytest.raises(AssertionError):
        fuzz.later_loss_drift(run(losses), REF, lambda: other)
