"""Pipeline parallelism x ZeRO: split a HF decoder into stages, run torch.distributed.pipelining
schedules, ZeRO inside each stage's data-parallel group. See docs/pipeline.md."""

from hfzero.parallel.pipeline.config import PipelineConfig
from hfzero.parallel.pipeline.driver import Pipeline, pipeline, pipeline_of

__all__ = ["Pipeline", "PipelineConfig", "pipeline", "pipeline_of"]
