"""Candidate stage: run engine cases on the frozen rollout and judge them against frozen bounds."""

WORKER = "qualify.candidate.worker"
"""The module every case's ranks run (python -m; qualify.case.launch.launch starts it): the candidate stage's and the
rounds' training steps."""
