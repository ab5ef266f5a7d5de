"""First-divergence localization (`qualify diagnose`): per-layer activations and gradients of a candidate case
against the reference at step 1, judged by per-layer bounds frozen with the per-tensor ones.

hooks: forward-hook capture of an HF model's decoder layers and final norm (reference and HF-based engines);
bounds: per-layer metrics and the frozen layer bounds; localize: computation-order judging and the first
departure; run: the command's library function; worker: the engine launch that exposes its activations.
"""
