"""CPU worker: vLLM's CPUWorker with the diffusion model runner."""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_dllm.serving.compat import has_v1_runners, init_cpu_worker_device
from vllm_dllm.worker.runner import DiffusionModelRunner


class DiffusionCPUWorker(CPUWorker):
    def init_device(self):
        if has_v1_runners():
            # CPUWorker binds threads, sets up the distributed group and then builds
            # its own runner, which we replace.
            super().init_device()
        else:
            # vLLM 0.34's CPUWorker builds its V2 runner there, which needs triton-cpu
            # and sizes buffers we never use: the same set-up without it.
            init_cpu_worker_device(self)
        self.model_runner = DiffusionModelRunner(self.vllm_config, torch.device("cpu"))
