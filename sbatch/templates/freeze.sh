{{ header }}

# Bounds and the acceptance manifest; a requeued job finds them frozen and refuses to freeze differently.
{{ srun }} {{ qualify }} freeze {{ run }}
