"""The step-time model checked against published TPU measurements, and its fitted constants.

The reference points are MaxText's four v5e configurations (16B, 32B, 64B and 128B dense
decoders on one v5e-256 slice; AI-Hypercomputer/maxtext, MaxText/configs/v5e/README.md,
commit 76bd53b0f of December 2023): conf/experiment/maxtext_v5e_*.yaml rebuilds each in
this project, the planner compiles it for v5e-256 (bench/calibrate.py keeps the compiled
HLO under bench/calibration/), and the model replays it. MFU is compared as MaxText
defines it (train.py's calculate_training_tflops): 6 x parameters x tokens plus causal
attention, 6 x heads x layers x head_dim x length^2 per sequence, per chip per step, over
the step time and the 197 TFLOP/s peak. So a published MFU is a published step time.

The fitted constants (`FITTED`) are StepModel efficiencies, fitted by least squares on the
log of estimated / published step time over the four points; `leave_one_out` fits on three
and predicts the fourth.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from capibara_exp.base import model_facts
from capibara_exp.base.paths import CONF_DIR
from capibara_exp.base.topologies import Chip
from capibara_exp.tuning import profile, tpu_slice
from capibara_exp.tuning.estimate import FITTED, StepModel, estimate
from capibara_exp.tuning.profile import StepProfile

# The compiled configurations, kept beside the benchmark that fits them (a source checkout).
DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "calibration"
SOURCE = ("AI-Hypercomputer/maxtext MaxText/configs/v5e/README.md (commit 76bd53b0f, "
          "2023-12-15), one v5e-256 slice")


@dataclasses.dataclass(frozen=True)
class Published:
    experiment: str  # conf/experiment/<name>.yaml
    mfu: float  # MaxText's MFU on one v5e-256
    tflops_per_chip: float


PUBLISHED = (
    Published("maxtext_v5e_16b", 0.6110, 120.0),
    Published("maxtext_v5e_32b", 0.6686, 132.0),
    Published("maxtext_v5e_64b", 0.5990, 118.0),
    Published("maxtext_v5e_128b", 0.5606, 110.0),
)
TIERING = ("AI-Hypercomputer/maxtext docs/reference/models/tiering.md (commit 20a91e12a); "
           "recipes in benchmarks/maxtext_trillium_model_configs.py, MaxText/configs/v5p/")


@dataclasses.dataclass(frozen=True)
class Checked:
    """A published result on another generation: estimated with the v5e-fitted constants
    and compared with MaxText's figure, never fitted on (issue 27)."""

    experiment: str  # conf/experiment/<name>.yaml
    mfu: float | None  # MaxText's published MFU; None: none published
    per_chip_batch: int  # the recipe's per_device_batch_size
    kept: bool = False  # compiled, its HLO kept in DATA_DIR (bench/check_independent.py)


INDEPENDENT = (
    Checked("maxtext_v5p_32b", 0.7147, 7, kept=True),
    Checked("maxtext_v5p_128b", 0.6868, 1, kept=True),
    Checked("maxtext_v5p_llama2_70b", 0.654, 4, kept=True),
    Checked("maxtext_v5p_llama2_7b", None, 4, kept=True),
    Checked("maxtext_v6e_llama3_8b", 0.4546, 4, kept=True),
    Checked("maxtext_v6e_llama3_70b", 0.5033, 4),
)
# The constants fitted here; their shipped values are estimate.FITTED (the planner's model).
FIT_PARAMETERS = ("mxu_efficiency", "collective_overlap")


def maxtext_flops_per_chip(model: dict, batch_size: int, length: int, chips: int) -> float:
    """MaxText's training FLOPs per chip per step (model_facts owns the count)."""
    return model_facts.maxtext_train_flops_per_step(model_facts.sizes(model), batch_size,
                                                    length) / chips


@dataclasses.dataclass
class Point:
    """One published configuration as compiled here."""

    published: Published
    profile: StepProfile
    maxtext_flops: float  # per chip per step, MaxText's count

    def published_step_s(self, chip: Chip) -> float:
        return self.maxtext_flops / (self.published.mfu * chip.peak_flops)

    def estimated_mfu(self, chip: Chip, model: StepModel) -> float:
        """MFU by MaxText's count at the model's estimated step time."""
        step = estimate(self.profile, chip, 1.0, model).step_s
        return self.maxtext_flops / (step * chip.peak_flops)


def _log_errors(points: Sequence[Point], chip: Chip, model: StepModel) -> list[float]:
    return [math.log(p.estimated_mfu(chip, model) / p.published.mfu) for p in points]


def fit(points: Sequence[Point], chip: Chip, parameters: Sequence[str] = FIT_PARAMETERS,
        base: StepModel | None = None) -> StepModel:
    """The StepModel whose `parameters` minimise the squared log error of estimated vs
    published MFU over the points (scipy's bounded least squares, efficiencies in
    [0.05, 1.5]: above 1 would mean the datasheet undersells the chip)."""
    from scipy.optimize import least_squares

    base = base or StepModel()

    def model_of(values: Sequence[float]) -> StepModel:
        return dataclasses.replace(base, **dict(zip(parameters, values, strict=True)))

    start = [getattr(base, name) for name in parameters]
    found = least_squares(lambda v: _log_errors(points, chip, model_of(v)), start,
                          bounds=([0.0] * len(parameters), [1.5] * len(parameters)))
    return model_of(found.x)


def leave_one_out(points: Sequence[Point], chip: Chip,
                  fitter: Callable[..., StepModel] = fit) -> list[tuple[Point, StepModel, float]]:
    """For each point: (point, model fitted on the others, that model's MFU estimate)."""
    out = []
    for i, point in enumerate(points):
        model = fitter([p for j, p in enumerate(points) if j != i], chip)
        out.append((point, model, point.estimated_mfu(chip, model)))
    return out


def compose(experiment: str, overrides: Sequence[str] = ()) -> Any:
    """An experiment composed as capibara-exp composes it (without running anything)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from capibara_exp.composing.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"experiment={experiment}",
                                                  "model_dir=/tmp/capibara-calibration",
                                                  *overrides])


# Model options whose values here build the network the HLO was kept with (the T5-style
# decoder, before the open-model families' options existed): a key at this value is left out
# of the fingerprint, so adding an option with a neutral default keeps the HLO current, and
# setting it otherwise in an experiment makes the HLO stale.
_NEUTRAL_OPTIONS: dict[str, Any] = {
    "vocabulary": "byte", "vocabulary_path": None, "num_kv_heads": None,
    "rope_max_wavelength": 10000.0, "rope_scaling": "none", "rope_scaling_factor": 1.0,
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
    "rope_original_max_positions": 8192, "local_rope_max_wavelength": None, "qkv_bias": False,
    "qk_norm": False, "query_pre_attn_scalar": None, "attn_logit_softcap": None,
    "final_logit_softcap": None, "sliding_window": None, "sliding_window_pattern": None,
    "norm_epsilon": 1e-6, "norm_scale_plus_one": False, "norm_placement": "pre",
    "scale_embeddings": False, "normalize_embedding_logits": True,
    "remat_save": [], "remat_offload": [], "splash_block": 512, "splash_fused_bwd": False,
}


def fingerprint(cfg: Any) -> str:
    """A digest of what decides the compiled step: model, data shape, optimizer, trainer,
    partitioning and topology. The kept HLO of an experiment edited since is stale."""
    import hashlib

    from omegaconf import OmegaConf

    keys = ("model", "optimizer", "partitioning", "topology")
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if k != "topology" else cfg[k]
             for k in keys}
    plain["model"] = {k: v for k, v in plain["model"].items()
                      if k not in _NEUTRAL_OPTIONS or _NEUTRAL_OPTIONS[k] != v}
    part = plain["partitioning"]
    if part.get("activation_sharding") == "batch" or part.get("num_partitions") == 1:
        part.pop("activation_sharding", None)  # without a model axis every layout is batch's
    plain["data"] = {"batch_size": cfg.data.batch_size,
                     "lengths": OmegaConf.to_container(cfg.data.task_feature_lengths)}
    plain["trainer"] = {"num_microbatches": cfg.trainer.num_microbatches}
    if cfg.get("libtpu_init_args"):  # the flags the step was compiled under (none: neutral)
        plain["libtpu_init_args"] = " ".join(str(cfg.libtpu_init_args).split())
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]


def compile_point(experiment: str, where: Path) -> dict[str, Any]:
    """Compile a published configuration for its slice; keep <where>/<experiment>.hlo.gz and
    .json (what the compile told, the devices' coordinates, MaxText's FLOP count)."""
    import jax
    from omegaconf import OmegaConf

    from capibara_exp.base import topologies
    from capibara_exp.tuning import aot

    cfg = compose(experiment)
    target = topologies.get(cfg.topology)
    # libtpu reads its flags once per process: one experiment's flags per process.
    devices = tpu_slice.devices(target, cfg.get("libtpu_init_args") or None)
    compiled = aot.compile_step(cfg, devices, target.chip)
    if not compiled.feasible:
        raise RuntimeError(f"{experiment} does not compile for {cfg.topology}: {compiled.reason}")
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{experiment}.hlo.gz").write_bytes(gzip.compress(compiled.hlo_text.encode(), 9))
    model = OmegaConf.to_container(cfg.model, resolve=True)
    record = {"experiment": experiment, "topology": cfg.topology, "chips": target.chips,
              "compile_s": compiled.compile_s, "memory_bytes": compiled.memory_bytes,
              "model_flops": compiled.model_flops,
              "maxtext_flops": maxtext_flops_per_chip(
                  model, cfg.data.batch_size, max(cfg.data.task_feature_lengths.values()),
                  target.chips),
              "device_coords": compiled.profiled["device_coords"],
              "fingerprint": fingerprint(cfg),
              "jax": jax.__version__, "libtpu": tpu_slice.libtpu_version()}
    (where / f"{experiment}.json").write_text(json.dumps(record) + "\n")
    return record


def load_points(where: Path = DATA_DIR) -> list[Point]:
    """The published configurations as compiled and kept under `where`, profiled now."""
    points = []
    for published in PUBLISHED:
        meta_path = where / f"{published.experiment}.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} is missing: run `python bench/calibrate.py "
                                    "--compile` to compile the published configurations")
        meta = json.loads(meta_path.read_text())
        text = gzip.decompress((where / f"{published.experiment}.hlo.gz").read_bytes()).decode()
        step = profile.profile(text, meta["chips"], meta["device_coords"])
        points.append(Point(published, step, meta["maxtext_flops"]))
    return points


GOAL = 0.15  # the goal: every leave-one-out estimate within 15% of the published MFU


def report(points: Sequence[Point], chip: Chip) -> tuple[list[str], bool]:
    """The published-vs-estimated table (Markdown lines) and whether it meets the goal:
    every leave-one-out estimate within GOAL, and FITTED the constants the fit gives."""
    from capibara_exp.tuning.estimate import DATASHEET

    fitted = fit(points, chip)
    loo = leave_one_out(points, chip)
    lines = [f"Published: {SOURCE}", "",
             "| configuration | published MFU | est. datasheet | est. fitted on all 4 | "
             "leave-one-out est. | leave-one-out error |", "|---|---|---|---|---|---|"]
    errors = []
    for point, _, predicted in loo:
        errors.append(predicted / point.published.mfu - 1)
        lines.append(f"| {point.published.experiment} | {point.published.mfu:.1%} | "
                     f"{point.estimated_mfu(chip, DATASHEET):.1%} | "
                     f"{point.estimated_mfu(chip, fitted):.1%} | {predicted:.1%} | "
                     f"{errors[-1]:+.1%} |")
    lines += ["", "Constants fitted on all four (shipped as tuning/estimate.py FITTED):"]
    for name in FIT_PARAMETERS:
        loo_values = ", ".join(f"{getattr(m, name):.3f}" for _, m, _ in loo)
        lines.append(f"  {name} = {getattr(fitted, name):.3f} (leave-one-out fits: "
                     f"{loo_values}; shipped {FITTED[name]:.3f})")
    shipped = all(abs(FITTED[n] - getattr(fitted, n)) < 5e-3 for n in FIT_PARAMETERS)
    worst = max(abs(e) for e in errors)
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    passed = worst <= GOAL and shipped
    lines += ["", f"leave-one-out error: worst {worst:.1%}, RMS {rms:.1%} (goal: each <= "
                  f"{GOAL:.0%}); shipped constants {'match' if shipped else 'DIFFER from'} "
                  f"the fit: {'PASS' if passed else 'FAIL'}"]
    return lines, passed
