"""CUDA worker: vLLM's GPU Worker with the diffusion model runner."""

from __future__ import annotations

import time

import torch
from vllm.utils.mem_utils import memory_profiling
from vllm.v1.worker.gpu_worker import Worker

from vllm_dllm.log import get_logger
from vllm_dllm.worker.runner import DiffusionModelRunner

logger = get_logger(__name__)


class DiffusionGPUWorker(Worker):
    def _make_model_runner(self):
        return DiffusionModelRunner(self.vllm_config, self.device)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """KV cache bytes, with vLLM's semantics: `--kv-cache-memory` when given, else
        this instance's share of the device (`--gpu-memory-utilization` of its total
        memory) minus what the instance consumed since it started (weights included)
        and the transient peak of a dummy step at the token and logits caps (vLLM's
        memory_profiling empties torch's cache before measuring, so the peak is
        counted once)."""
        if kv_cache_bytes := self.cache_config.kv_cache_memory_bytes:
            self.model_runner.profile_step()  # the caps must still fit, and Triton compiles
            return int(kv_cache_bytes)
        with memory_profiling(self.init_snapshot, weights_memory=self.model_runner.model_memory_usage) as profile:
            self.model_runner.profile_step()
        available = self.requested_memory - profile.non_kv_cache_memory
        logger.info("Diffusion step profiled: %s; KV cache gets %.2f GiB", profile, available / (1 << 30))
        return max(int(available), 0)

    def compile_or_warm_up_model(self):
        """One dummy step at the caps with the KV pool bound, so the first requests do
        not pay for compiling the paged-attention path (the profile step before the
        pool existed attended in flight).  Reuse graphs are still captured on first
        use of each shape."""
        from vllm.v1.worker.worker_base import CompilationTimes

        start = time.perf_counter()
        self.model_runner.profile_step()
        torch.cuda.synchronize()
        logger.info("Diffusion step warmed up with the KV pool in %.1f s", time.perf_counter() - start)
        # The CUDA attention path, its graphs and the Triton Philox against their
        # torch references (worker/self_check.py): fall back, or refuse a forced backend.
        self.model_runner.self_check()
        return CompilationTimes(language_model=0.0, encoder=0.0)
