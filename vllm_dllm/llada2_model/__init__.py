"""The LLaDA2-format task model shipped with the plugin (trained by
`lab.train --arch llada2`; lab/training-log.md).

The folder is an unmodified LLaDA2.x checkpoint (llada2_moe, 8 layers, 14.03M parameters of which
7.07M are active per token, bf16):
`vllm serve <PATH>` serves it.  `curriculum.json` holds the curriculum levels of the
run that wrote it, so `train --arch llada2 --init-from <PATH>` continues that run on any
machine.  Its held-out accuracy is in benchmarks/results/llada2-shipped/; `make serve`
serves the LLaDA-format model (vllm_dllm.default_model), which is ahead of this one on
addition (README).
`python -m vllm_dllm.llada2_model` prints the path.
"""

import os

# A str, as vLLM takes a model name or path (`LLM(model=PATH)`, `vllm serve PATH`).
PATH = os.path.dirname(os.path.realpath(__file__))
