"""The judge: a case's sealed evidence against the frozen bounds, row by row, below every stage that judges.

case: judge_case, every row family of one case (and the reference runs, replays and TP1/DP1/padded cases it is
compared with); steps: the tensor rows of each step and the evidence checks; decided: clip decisions; derived and
derived_adamw: derivations from the case's own values; formula: the declared logprob formula; tiers: invariance
tiers; layout_probe, layer_probe, rollout_exact, padding, routing_rows: the probes a case's ranks run and the rows
made of them; agreement, dp, packed: a case's cross-rank contract, DP slices and packed micro-batches, which the
rows' meaning depends on; judged: a case's rows kept beside its evidence. The candidate stage, `qualify report`'s
re-judge, the replay and the rounds' checks all import it; it imports none of them.
"""
