"""The small task model shipped with the plugin (trained by lab.train).

The folder is an unmodified LLaDA checkpoint: `vllm serve <PATH>` serves it.
`python -m vllm_dllm.default_model` prints the path.
"""

import os

# A str, as vLLM takes a model name or path (`LLM(model=PATH)`, `vllm serve PATH`).
PATH = os.path.dirname(os.path.realpath(__file__))
