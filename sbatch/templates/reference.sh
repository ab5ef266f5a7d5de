{{ header }}

# vLLM capture (its TP from the matrix) then HF reference scoring. A requeued job resumes:
# complete and verified outputs are skipped, partial ones redone.
{{ srun }} {{ qualify }} reference {{ matrix }} --run {{ run }} --stage all
