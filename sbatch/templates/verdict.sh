{{ header }}

# Every array task completed (afterok): collect the verdict over the cases, then verify the acceptance.
# Exit 1: qualification or verification failed; 2: an input error.
verdict=0
{{ srun }} {{ qualify }} candidate {{ matrix }} --run {{ run }}{{ only }} || verdict=$?
verify=0
{{ srun }} {{ qualify }} verify {{ acceptance }} || verify=$?
echo "qualify-slurm: verdict exit ${verdict}, verify exit ${verify}"
exit $(( verdict > verify ? verdict : verify ))
