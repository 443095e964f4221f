"""CUDA worker: vLLM's GPU Worker with the diffusion model runner."""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu_worker import Worker

from vllm_dllm.worker.runner import DiffusionModelRunner


class DiffusionGPUWorker(Worker):
    def _make_model_runner(self):
        return DiffusionModelRunner(self.vllm_config, self.device)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Free memory after a dummy step at the token and logits caps."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.model_runner.profile_step()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * self.cache_config.gpu_memory_utilization - (total - free) - peak_extra
        return max(int(budget), 0)

    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)
