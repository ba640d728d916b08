"""The paper's Table 1 and Table 2 layouts from ``hfzero.planning.estimate`` (no Streamlit here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from hfzero.planning import estimate as est

GB = 1e9
"""The paper's GB: 1e9 bytes."""

PAPER_DPS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
"""The data-parallel degrees of the paper's Table 1."""


def model_states_table(models: Mapping[str, float], dps: Sequence[int], *, dtype: str = "bf16",
                       optimizer: str = "adam", offload_optimizer: bool = False,
                       persistent_params: float = 0, frozen_params: float = 0) -> pd.DataFrame:
    """Per-device model-state GB in the paper's Table 1 layout (``frozen_params``: Ψ_f beside each Ψ,
    parameter bytes only: whole at stages 0-2, /N_d at stage 3).

    Rows are the data-parallel degrees ``dps`` (index "DP"); columns are (model name, stage name)
    pairs for every stage 0-3, stage names from ``hfzero.planning.estimate.STAGE_NAMES``. ``models`` maps a
    display name to its Ψ. Raises ``EstimateError`` for an unknown dtype/optimizer or a bad N_d.
    """
    precision = est.precision_bytes(dtype, optimizer)
    columns: dict[tuple[str, str], list[float]] = {}
    for name, psi in models.items():
        for stage in est.STAGES:
            columns[(name, est.STAGE_NAMES[stage])] = [
                est.model_states_bytes(psi, dp, stage, param_bytes=precision.param_bytes,
                                       grad_bytes=precision.grad_bytes, optimizer_k=precision.optimizer_k,
                                       persistent_params=min(persistent_params, psi),
                                       offload_optimizer=offload_optimizer, frozen_params=frozen_params) / GB
                for dp in dps
            ]
    frame = pd.DataFrame(columns, index=pd.Index(list(dps), name="DP"))
    frame.columns = pd.MultiIndex.from_tuples(frame.columns, names=["model", "stage"])
    return frame


def max_params_table(device_memory_bytes: float, dps: Sequence[int], *, dtype: str = "bf16",
                     optimizer: str = "adam", offload_optimizer: bool = False) -> pd.DataFrame:
    """The largest model (parameters) whose model states fit ``device_memory_bytes`` per device:
    rows N_d, columns the stage names (the theoretical columns of the paper's Table 2, MP = 1)."""
    precision = est.precision_bytes(dtype, optimizer)
    columns = {
        est.STAGE_NAMES[stage]: [
            est.max_params(device_memory_bytes, dp, stage, param_bytes=precision.param_bytes,
                           grad_bytes=precision.grad_bytes, optimizer_k=precision.optimizer_k,
                           offload_optimizer=offload_optimizer)
            for dp in dps
        ]
        for stage in est.STAGES
    }
    return pd.DataFrame(columns, index=pd.Index(list(dps), name="DP"))


def parse_count(text: str, what: str) -> float:
    """"7e9" -> 7e9 (a parameter count >= 0). Raises ``EstimateError`` naming ``what``."""
    try:
        value = float(text.strip() or "0")
    except ValueError:
        raise est.EstimateError(f"{what} must be a number such as 7e9, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise est.EstimateError(f"{what} must be a finite number >= 0, got {text!r}")
    return value


def parse_dps(text: str) -> list[int]:
    """"1, 4, 16" -> [1, 4, 16]. Raises ``EstimateError`` naming a bad entry."""
    dps = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise est.EstimateError(f"N_d values must be positive integers separated by commas, got {part!r}")
        dps.append(int(part))
    if not dps:
        raise est.EstimateError("give at least one N_d value, e.g. 1, 4, 16, 64")
    return dps
