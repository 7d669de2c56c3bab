"""A fault injected at one rank's transfer boundary, inside real vLLM worker processes.

``FaultyRankConnector`` is `TierCacheConnector` unchanged, except that on TP rank 1 the first L1 → L0
load raises (an I/O error at the copy): vLLM loads it via ``kv_connector_module_path =
"tests.vllm_support.faulty"``. The other rank's load succeeds; the job fails as a whole.
"""
from tiercache.connectors.vllm import TierCacheConnector

FAULTY_RANK = 1


class FaultyRankConnector(TierCacheConnector):
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        worker = self.offload_worker
        if worker.shard.tp_rank != FAULTY_RANK:
            return
        handlers = worker.stack.engine._handlers
        real = handlers[("cpu", "device")]
        calls = []

        def first_load_fails(plan, progress=None):
            calls.append(plan.job_id)
            if len(calls) == 1:
                raise OSError("injected: rank 1's first load from L1 fails")
            return real(plan, progress)

        handlers[("cpu", "device")] = first_load_fails
