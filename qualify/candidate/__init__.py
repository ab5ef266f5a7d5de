"""Candidate stage: run engine cases on the frozen rollout and judge them against frozen bounds.

stage: the stage's entry (run_candidates) and its named steps; launches: the scheduling (Scheduler: launch groups on
a thread pool, judging what is sealed meanwhile); schedule: the GPU plan; resume: the resume key; worker: one rank of
a case; imported, plugin_contract: the code a case imported, the engine plugin contract. The judge itself is
qualify.judge."""

WORKER = "qualify.candidate.worker"
"""The module every case's ranks run (python -m; qualify.case.launch.launch starts it): the candidate stage's and the
rounds' training steps."""
