"""First-divergence localization (`qualify diagnose`): per-layer activations and gradients of a candidate case
against the reference at step 1, judged by per-layer bounds frozen with the per-tensor ones.

The forward-hook capture of a model's layers is qualify.models.hooks (the reference and the engines use it), the
per-layer metrics and frozen layer bounds qualify.bounds.layers. localize: computation-order judging and the first
departure; stage: the command's library function; worker: the engine launch that exposes its activations.
"""
