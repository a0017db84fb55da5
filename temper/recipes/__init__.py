"""Verified recipes: plain functions returning a Config, one module per model family."""
