"""DCP checkpoints and Hugging Face conversion."""
