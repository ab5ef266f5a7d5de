{{ header }}

# vLLM and the trainer in one job ({{ topology }} GPUs): the actor's new weights are installed on every
# vLLM rank, acknowledged and the prefix cache reset between rounds, then the rejection probes.
# A requeued job finds a sealed rounds verdict and returns it. Exit 1: a check or probe failed.
{{ srun }} {{ qualify }} rounds {{ matrix }} --run {{ run }} {{ rounds }}
