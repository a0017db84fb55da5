"""Small helpers shared by every layer: device choice, peak FLOP/s."""
