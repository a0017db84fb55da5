"""Parallelism over a process group: data parallelism now; FSDP2, EP and SP build here."""
