"""Temper: PyTorch-native post-training for dense and mixture-of-experts language models."""
