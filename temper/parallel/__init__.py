"""Parallelism over device meshes: degrees and meshes (`dims`), FSDP2/HSDP, activation
checkpointing, compile, layout-independent init and the global gradient norm, applied by
`parallelize.parallelize_decoder`. Sequence and expert parallelism build here next."""
