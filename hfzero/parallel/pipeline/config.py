"""PipelineConfig: the pipeline options (the ZeRO options stay in ZeroConfig)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from hfzero.config import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Options of ``hfzero.pipeline``; the Trainer and launcher expose field ``x`` as ``--zero_pp_x``
    (``pp_size`` as ``--zero_pp_size``)."""

    pp_size: int = 2
    """Pipeline stages; the data-parallel size is world / pp_size (ZeRO runs inside each stage's dp group)."""

    schedule: str = "1F1B"
    """torch.distributed.pipelining schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS (two stages per
    rank), InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (zero-bubble: two stages per rank)."""

    n_microbatches: int = 4
    """Micro-batches per step (per data-parallel replica). In the Trainer (``--zero_pp_n_microbatches``)
    the default is its gradient_accumulation_steps: the accumulated batches are the micro-batches."""

    layers_per_stage: tuple[int, ...] | None = None
    """Decoder blocks per stage (all stages, in order; "3,5" on the command line); None balances stages by
    parameter count."""

    stage3_gather: Literal["step", "micro"] = "step"
    """ZeRO-3 only: "step" gathers each unit once per step and keeps it for all micro-batches
    (torchtitan's choice: P_os+g parameter memory inside the step, one gather per step); "micro"
    gathers per micro-batch forward and backward (true P_os+g+p, 2 x n_microbatches gathers)."""

    stage3_cross_prefetch: bool = True
    """ZeRO-3 with ``stage3_gather="micro"`` only: at each pass's last unit, start gathering the next pass's
    first unit (the schedule's pass order from the previous step) and carry it across the pass boundary, so
    the gather overlaps the P2P waits ([Note: prefetch across micro-batches]); False gathers each pass's
    units from its start only. Gathers per step are the same either way ("true"/"false" on the command line)."""

    def __post_init__(self) -> None:
        from hfzero.parallel.pipeline.schedule import resolve_schedule

        if not isinstance(self.pp_size, int) or self.pp_size < 1:
            raise ConfigError(f"PipelineConfig.pp_size={self.pp_size!r} must be a positive integer")
        if not isinstance(self.n_microbatches, int) or self.n_microbatches < 1:
            raise ConfigError(f"PipelineConfig.n_microbatches={self.n_microbatches!r} must be a positive integer")
        resolve_schedule(self.schedule)
        if self.stage3_gather not in ("step", "micro"):
            raise ConfigError(f'PipelineConfig.stage3_gather={self.stage3_gather!r} must be "step" or "micro"')
        if not isinstance(self.stage3_cross_prefetch, bool):
            raise ConfigError(f"PipelineConfig.stage3_cross_prefetch={self.stage3_cross_prefetch!r} must be True or False")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def option(field: str) -> str:
        """The Trainer/launcher option of ``field`` without its ``zero_`` prefix: ``pp_size``, ``pp_schedule``, ..."""
        return field if field.startswith("pp_") else f"pp_{field}"

    @classmethod
    def options(cls) -> dict[str, str]:
        """Option (``pp_schedule``) -> field (``schedule``), for every field."""
        return {cls.option(f.name): f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_strings(cls, values: dict[str, str], **defaults: Any) -> "PipelineConfig":
        """A config from option texts (``{"pp_size": "2", "pp_layers_per_stage": "1,3"}``) over ``defaults``
        (field values); ConfigError names a bad option."""
        fields = cls.options()
        converted = dict(defaults)
        for option, raw in values.items():
            if option not in fields:
                raise ConfigError(f"unknown pipeline option {option!r}; valid ones are {sorted(fields)}")
            field = fields[option]
            try:
                if field in ("pp_size", "n_microbatches"):
                    converted[field] = int(raw)
                elif field == "layers_per_stage":
                    converted[field] = tuple(int(x) for x in str(raw).replace(" ", "").split(",") if x)
                elif field == "stage3_cross_prefetch":
                    converted[field] = _boolean(raw)
                else:
                    converted[field] = str(raw)
            except ValueError:
                what = {"layers_per_stage": "a comma list of integers",
                        "stage3_cross_prefetch": "true or false"}.get(field, "an integer")
                raise ConfigError(f"--zero_{option}: cannot read {raw!r} as {what}") from None
        return cls(**converted)


def _boolean(raw: Any) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case); ValueError otherwise."""
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)
