"""The small task model shipped with the plugin (trained by vllm_dllm.tools.train).

The folder is an unmodified LLaDA checkpoint: `vllm serve <PATH>` serves it.
`python -m vllm_dllm.default_model` prints the path.
"""

import pathlib

PATH = pathlib.Path(__file__).resolve().parent
