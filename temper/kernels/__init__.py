"""Fused ops, each beside a plain-PyTorch reference that CPU tests compare against."""
