"""tools/fuzz_layouts.py's excuse for a later loss's drift: summation order's, as one process's
own at another micro_batch, and nothing more; multi-token prediction's mtp_loss held to the loss's
bounds."""

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


def mtp_run(depth1, dtype_fields=None):
    """A run whose depth 1 reports `depth1` as mtp_loss, its losses REF's."""
    return (REF[0], None, [{"mtp_loss": [x], **(dtype_fields or {})} for x in depth1])


MTP_REF = mtp_run([5.2, 5.0, 4.9])


def test_mtp_loss_drift_is_excused_as_the_loss():
    assert fuzz.loss_drifts(mtp_run([5.2, 5.0 + 1e-6, 4.9]), MTP_REF, lambda: None) is None
    note = fuzz.loss_drifts(mtp_run([5.2, 5.0, 4.9 + 7e-5]), MTP_REF, lambda: mtp_run([5.2, 5.0, 4.9 - 7e-5]))
    assert note.startswith("mtp_loss 1 drift 7")


@pytest.mark.parametrize("got, other", [
    (mtp_run([5.2 + 1e-4, 5.0, 4.9]), mtp_run([5.2 + 1e-4, 5.0, 4.9])),  # the first step's
    (mtp_run([5.2, 5.0, 4.9 + 1e-3]), mtp_run([5.2, 5.0, 4.9 + 1e-5])),  # far past one process's own drift
    (run(REF[0]), run(REF[0])),  # a layout that reports no mtp_loss
])
def test_mtp_loss_misses_are_not_excused(got, other):
    with pytest.raises(AssertionError):
        fuzz.loss_drifts(got, MTP_REF, lambda: other)


@pytest.mark.parametrize("step2, passes", [(5.0 + 0.05, True), (5.0 + 0.07, False)])
def test_low_precision_mtp_loss_has_the_losss_bound(step2, passes):
    """bf16: within three times DTYPE_ATOL (0.06) after the first step, as the loss."""
    fields = {"grad_norm": 1.0, "skipped": False}
    got, ref = mtp_run([5.2, step2, 4.9], fields), mtp_run([5.2, 5.0, 4.9], fields)
    overrides = {"parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 1}, "train": {"dtype": "bf16"}}
    if passes:
        assert fuzz.check(got, ref, overrides, lambda: None) == "ok"
    else:
        with pytest.raises(AssertionError, match="mtp_loss 1"):
            fuzz.check(got, ref, overrides, lambda: None)
