"""Memory: what a run holds (host RSS, device bytes in use and peak per device, logged with
the step metrics), a warning line above `memory_warn_fraction` of a limit, and checks
before anything is allocated that the run fits at all: sizes that are integers, host
batches and held eval batches within the host's memory, and the compiled train step's
memory analysis within each device's (or, on CPU, the host's) memory.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import psutil

from capibara_exp.base.errors import ConfigError

GiB = float(1 << 30)
# Host-side copies of a train batch at once: the input pipeline's prefetched one, the one
# being placed on the devices, and (on CPU) the device copy itself, with room to spare.
TRAIN_BATCH_COPIES = 4
PREFIX = "memory/"
# Unrolled layers each trace (tens of ms here) and compile on their own: past this many, a
# run would spend hours before its first step (the deepest published models have ~100-200).
MAX_UNROLLED_LAYERS = 1024


def _gib(n: float) -> str:
    return f"{n / GiB:.3g} GiB"


def host_limit_bytes() -> float:
    """The host's memory: physical memory, or a cgroup's limit when lower (a container)."""
    total = float(psutil.virtual_memory().total)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
    return total


def host_available_bytes() -> float:
    return min(float(psutil.virtual_memory().available), host_limit_bytes())


def memory_metrics() -> dict[str, float]:
    """Host RSS (now and peak) and, where the backend reports them, bytes in use, peak and
    limit of each of this process's devices."""
    rss = float(psutil.Process().memory_info().rss)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = float(peak_kib * (1 if sys.platform == "darwin" else 1024))
    # The kernel's high-water mark lags the RSS it counts now (it is folded in lazily), so a
    # peak read just after can be below it: the peak is at least the RSS seen.
    out = {f"{PREFIX}host_rss_bytes": rss, f"{PREFIX}host_rss_peak_bytes": max(peak, rss),
           f"{PREFIX}host_limit_bytes": host_limit_bytes()}
    for device in jax.local_devices():
        stats = device.memory_stats() or {}  # None on CPU
        for key, name in (("bytes_in_use", "bytes_in_use"), ("peak_bytes_in_use", "peak_bytes"),
                          ("bytes_limit", "limit_bytes")):
            if key in stats:
                out[f"{PREFIX}device_{device.id}_{name}"] = float(stats[key])
    return out


class MemoryWatch:
    """Warns (one line) when host RSS or a device's peak passes `warn_fraction` of its limit,
    again only when it has grown by another 5% of the limit."""

    def __init__(self, warn_fraction: float, say: Callable[[str], None]):
        if not 0.0 < warn_fraction <= 1.0:
            raise ValueError("train_script.train.memory_warn_fraction must be in (0, 1], got "
                             f"{warn_fraction}")
        self.warn_fraction = warn_fraction
        self.say = say
        self._warned: dict[str, float] = {}

    def check(self, m: Mapping[str, float]) -> None:
        pairs = [("host RSS", m.get(f"{PREFIX}host_rss_bytes"), m.get(f"{PREFIX}host_limit_bytes"))]
        for key, peak in m.items():
            if key.endswith("_peak_bytes") and key.startswith(f"{PREFIX}device_"):
                device = key[len(PREFIX):-len("_peak_bytes")]
                pairs.append((f"{device.replace('_', ' ')} peak", peak,
                              m.get(f"{PREFIX}{device}_limit_bytes")))
        for what, used, limit in pairs:
            if not used or not limit or used <= self.warn_fraction * limit:
                continue
            if used <= self._warned.get(what, 0.0) + 0.05 * limit:
                continue
            self._warned[what] = used
            self.say(f"warning: memory: {what} {_gib(used)} is {used / limit:.0%} of "
                     f"{_gib(limit)}, above memory_warn_fraction={self.warn_fraction}")


def check_integer_sizes(model: Any) -> None:
    """Every int field of the network's config dataclasses holds an int (1e5 is a float)."""
    module = getattr(model, "module", None)
    configs = [getattr(module, f.name, None) for f in dataclasses.fields(module)] if (
        dataclasses.is_dataclass(module)) else []
    for cfg in configs:
        if not dataclasses.is_dataclass(cfg):
            continue
        for field in dataclasses.fields(cfg):
            value = getattr(cfg, field.name)
            if field.type in (int, "int") and (isinstance(value, bool)
                                               or not isinstance(value, int)):
                raise ConfigError(f"nets.{type(cfg).__name__}.{field.name} must be an integer, "
                                  f"got {value!r}")


def check_network_bound(model: Any, length: int) -> None:
    """Before the network is traced (tracing 10^5 layers alone takes an hour): a lower bound
    on what one device must hold, the parameters fully sharded and one saved activation per
    layer for one example, against a device's memory; and a depth that can be traced."""
    from capibara_exp.base import model_facts

    module = getattr(model, "module", None)
    cfg = getattr(module, "config", None)
    names = ("num_layers", "emb_dim", "num_heads", "head_dim", "mlp_dim", "vocab_size")
    if cfg is None or not all(isinstance(getattr(cfg, n, None), int) for n in names):
        return
    sizes = model_facts.sizes(cfg, getattr(module, "moe_config", None))
    d, layers = cfg.emb_dim, cfg.num_layers
    itemsize = model_facts.DTYPE_BYTES.get(sizes.dtype, 4)
    counts = model_facts.counts(sizes)
    embedding = 4.0 * (counts.embedding * (1 if sizes.tied else 2)) / jax.device_count()
    depth = 4.0 * (counts.total - counts.embedding * (1 if sizes.tied else 2)) \
        / jax.device_count() + layers * length * d * itemsize
    limit, what = device_limit_bytes()
    if depth + embedding <= limit:
        if layers > MAX_UNROLLED_LAYERS and not getattr(cfg, "scan_layers", False):
            raise ConfigError(
                f"nets.{type(cfg).__name__}.num_layers={layers} unrolled (scan_layers=False): "
                f"tracing and compiling that many copies of a layer takes hours; set "
                f"model.scan_layers=true (one scanned layer: compile time flat in depth) or "
                f"unroll at most {MAX_UNROLLED_LAYERS}")
        return
    culprit = (f"nets.{type(cfg).__name__}.num_layers={layers}" if depth >= embedding else
               f"nets.{type(cfg).__name__}.vocab_size={cfg.vocab_size}")
    raise ConfigError(f"{culprit} (emb_dim={d}, mlp_dim={cfg.mlp_dim}): its parameters and one "
                      f"activation per layer alone need at least {_gib(depth + embedding)} per "
                      f"device, more than the {_gib(limit)} {what}")


def batch_bytes(cfg: Any, num_features: int) -> float:
    return float(cfg.batch_size) * max(cfg.task_feature_lengths.values()) * 4 * num_features


def check_host_sizes(train_cfg: Any, eval_cfg: Any, eval_steps: int, num_features: int) -> None:
    """Host batches and the eval batches held for the whole run fit the host's memory."""
    available = host_available_bytes()
    train = TRAIN_BATCH_COPIES * batch_bytes(train_cfg, num_features)
    if train > available:
        raise ConfigError(
            f"train/utils.DatasetConfig.batch_size={train_cfg.batch_size}: its host batches need "
            f"about {_gib(train)} ({TRAIN_BATCH_COPIES} copies of a batch), more than the "
            f"{_gib(available)} this host has available")
    if eval_cfg is not None and eval_steps > 0:
        held = eval_steps * batch_bytes(eval_cfg, num_features)
        if held > available:
            raise ConfigError(
                f"train_script.train.eval_steps={eval_steps}: the eval batches, held in memory "
                f"for every evaluation, need about {_gib(held)}, more than the "
                f"{_gib(available)} this host has available")


def step_bytes(compiled: Any) -> float:
    """Bytes per device a compiled step needs, from XLA's memory analysis: arguments +
    outputs - aliased + temporaries + code, or the backend's peak when larger (TPU reports a
    true peak; the CPU's leaves the temporaries out of it)."""
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes
             + stats.generated_code_size_in_bytes)
    return float(max(total, getattr(stats, "peak_memory_in_bytes", 0) or 0))


def device_limit_bytes() -> tuple[float, str]:
    """(bytes one device may use, what that is): the backend's limit, or on CPU the memory
    the host has available shared by its devices."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"of memory on device {jax.local_devices()[0].id}"
    n = jax.local_device_count()
    return host_available_bytes() / n, ("available on this host" if n == 1 else
                                        f"available on this host per device ({n} devices)")


def check_step_fits(compiled: Any, watch: MemoryWatch, batch_size: int) -> float:
    """The compiled step's bytes per device; ConfigError when over the limit (naming the
    batch size, the first thing to lower), a warning line when over the warn fraction."""
    need = step_bytes(compiled)
    limit, what = device_limit_bytes()
    if need > limit:
        raise ConfigError(
            f"train/utils.DatasetConfig.batch_size={batch_size}: the train step needs "
            f"{_gib(need)} per device (XLA's memory analysis of the "
            f"compiled step), more than the {_gib(limit)} {what}: lower data.batch_size or the "
            "model's sizes, raise trainer.num_microbatches, set model.remat_policy=full, or "
            "shard the parameters over more devices")
    if need > watch.warn_fraction * limit:
        watch.say(f"warning: memory: the train step needs {_gib(need)} per device, "
                  f"{need / limit:.0%} of the {_gib(limit)} {what} (above "
                  f"memory_warn_fraction={watch.warn_fraction})")
    return need
