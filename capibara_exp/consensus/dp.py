"""Differential privacy of federated rounds (DP-FedAvg, McMahan et al. 2018): the privacy
spent for a noise multiplier, and the noise multiplier a target epsilon needs, both by
dp-accounting's RDP accountant.

Each round's mechanism is the Gaussian mechanism on the clipped client updates with noise
std noise_multiplier x clip_norm on their sum. When a round samples m of N clients, it is
accounted as Poisson sampling with rate q = m / N (the usual accounting of fixed-size
client sampling, as in DP-FedAvg); when every client takes part, as the Gaussian
mechanism itself.
"""

from __future__ import annotations

import dp_accounting

MAX_NOISE_MULTIPLIER = 1e4  # the solver's upper bracket (a target this strict is refused)
# RDP orders: integers only (the fractional ones below 2 rarely bind here and make the
# accountant's series fail to converge, with a log line each, at large sampling rates).
ORDERS = [*range(2, 64), 128, 256, 512]


def _accountant() -> dp_accounting.rdp.RdpAccountant:
    return dp_accounting.rdp.RdpAccountant(ORDERS)


def _event(noise_multiplier: float, sampling_rate: float, rounds: int) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    one = gaussian if sampling_rate >= 1.0 else dp_accounting.PoissonSampledDpEvent(
        sampling_rate, gaussian)
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """(epsilon, delta)-DP of `rounds` rounds at this noise and sampling rate."""
    accountant = _accountant()
    accountant.compose(_event(noise_multiplier, sampling_rate, rounds))
    return float(accountant.get_epsilon(delta))


def noise_for_epsilon(target_epsilon: float, sampling_rate: float, rounds: int,
                      delta: float) -> float:
    """The smallest noise multiplier whose `rounds` rounds stay within (target_epsilon,
    delta)-DP (dp-accounting's calibrate_dp_mechanism, a bracketed search)."""
    if epsilon(MAX_NOISE_MULTIPLIER, sampling_rate, rounds, delta) > target_epsilon:
        raise ValueError(f"fedavg.target_epsilon={target_epsilon} cannot be reached at delta="
                         f"{delta} over {rounds} rounds, even with noise multiplier "
                         f"{MAX_NOISE_MULTIPLIER:g}: ask for a larger epsilon or fewer rounds")
    return float(dp_accounting.calibrate_dp_mechanism(
        _accountant, lambda z: _event(z, sampling_rate, rounds), target_epsilon, delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0), tol=1e-4))
