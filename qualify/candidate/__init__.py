"""Candidate stage: run engine cases on the frozen rollout and judge them against frozen bounds."""
