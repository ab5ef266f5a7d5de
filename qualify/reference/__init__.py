"""The independent Hugging Face reference: targets, scoring, controls."""
