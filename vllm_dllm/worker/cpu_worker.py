"""CPU worker: vLLM's CPUWorker with the diffusion model runner."""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_dllm.worker.runner import DiffusionModelRunner


class DiffusionCPUWorker(CPUWorker):
    def init_device(self):
        # CPUWorker binds threads, sets up the distributed group and then builds its
        # own runner, which we replace.
        super().init_device()
        self.model_runner = DiffusionModelRunner(self.vllm_config, torch.device("cpu"))
