"""Planning: what a run will need before it runs.

- ``estimate.py``: the ZeRO paper's memory model (model states per rank by stage, the largest model that
  fits, Ψ from a Hugging Face config, bytes communicated per step) and the smallest stage that fits.
- ``shapes.py``: the transformer shapes and the error type the estimators share.
- ``activations.py``: the activation model of Hugging Face decoders, encoders and encoder-decoders.
- ``quantized.py``: bytes per step with ZeRO++'s quantized collectives and hpZ, total and inter-node.
- ``plan.py``: ``hfzero plan``, every configuration ranked by throughput among those that fit;
  ``measured.py`` sets benchmark timings beside it, ``verify.py`` runs its top choice here.
- ``models.py``: the estimators applied to a live model (its optimizer's update rule, its activation estimate).
- ``autostage.py``: ``--zero_stage auto`` applied to a real model.

Pure arithmetic over configs and sizes: nothing here starts a process group or holds a tensor of a model.
"""
