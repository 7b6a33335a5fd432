"""Every estimate states where its constants come from: fitted on v5e only, with the
calibration's leave-one-out error bar, and a warning on a generation with no point."""

from __future__ import annotations

import pytest

from capibara_exp.base import topologies
from capibara_exp.tuning import calibration, estimate, plan_report


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_each_generation_has_datasheet_physics_and_a_stated_calibration(generation):
    chip = topologies.get(f"{generation}-8" if generation in ("v4", "v5p") else
                          f"{generation}-4").chip
    assert chip.generation == generation
    assert chip.peak_flops > 0 and chip.hbm_bytes_per_s > 0 and chip.ici_bytes_per_s > 0
    assert chip.dcn_bytes_per_s > 0 and 0 < chip.usable_hbm_bytes <= 1.01 * chip.hbm_bytes
    note = estimate.calibration_note(chip)
    assert note["calibrated_on"] == ["v5e"]
    assert note["est_error_bar"] == estimate.LEAVE_ONE_OUT_ERROR
    if generation == "v5e":
        assert note["calibration_warning"] == ""
    else:
        assert note["calibration_warning"].startswith(f"{generation} has no calibration point")
    line = plan_report._calibration_line(note)
    assert "fitted on v5e only" in line and "+-5.6%" in line
    assert ("Warning" in line) == (generation != "v5e")


def test_the_stated_error_bar_is_the_calibrations_worst_leave_one_out_error():
    chip = topologies.get("v5e-256").chip
    errors = [abs(predicted / point.published.mfu - 1)
              for point, _, predicted in calibration.leave_one_out(calibration.load_points(),
                                                                   chip)]
    assert round(max(errors), 3) == estimate.LEAVE_ONE_OUT_ERROR
