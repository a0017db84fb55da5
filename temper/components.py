"""Importing this module registers every built-in config rule and objective, without the
Engine's own imports (FSDP's wrappers, torch.compile's machinery): what the CLI needs to
parse and validate a config, so ``--help``, ``--list`` and a config error skip dynamo and
triton (about 0.5 s of CPU here: docs/recipes.md). ``import temper.engine`` imports it first.

The rules run in the order of these imports: parallel degrees, model fit, attention
backend, then the optimizer's, CPU offload's and quantization's."""

import temper.parallel.dims  # noqa: F401, I001
import temper.models  # noqa: F401
import temper.kernels.attention  # noqa: F401
import temper.objectives  # noqa: F401  (registers the built-in objectives)
import temper.optim  # noqa: F401
import temper.parallel.fsdp  # noqa: F401
import temper.quantize  # noqa: F401
