{{ header }}

# One array task per case; a requeued task skips a completed case and redoes a partial one.
cases=(
{{ cases }}
)
case=${cases[$SLURM_ARRAY_TASK_ID]}
echo "qualify-slurm: case ${case}"
{{ srun }} {{ qualify }} candidate {{ matrix }} --run {{ run }} --only "${case}"
