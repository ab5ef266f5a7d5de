"""Slurm support: cluster profiles, deterministic sbatch rendering, chained submission and waiting.

qualify uses Slurm and does not replace it: jobs are plain sbatch scripts chained with
--dependency=afterok, the candidate matrix is a job array, and state comes from squeue/scontrol.
"""
