"""What a vLLM worker learns at model build, once: the model label, its parallel placement,
the shared sampler seed and rate channel, vLLM's verdict on every backend per layer shape, and
(when vLLM allocates the KV cache) each layer's KV-cache group.

Model build and KV-cache allocation time only; nothing here runs per step.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from attnprof.aggregate.layers import LayerInfo
from attnprof.aggregate.worker_snapshot import kernel_groups
from attnprof.capture.vllm.args import report_key
from attnprof.contracts.snapshot import KernelGroup

__all__ = ["BackendReports", "learn_kv_groups", "learn_model", "sync_ranks"]


class BackendReports:
    """vLLM's verdict on every backend, asked once per layer shape (and selector inputs)."""

    def __init__(self, errors: Any, fallback: Any = None) -> None:
        self.errors = errors
        # Answers where vLLM cannot (a pinned backend): the host's derived matrix.
        self.fallback = fallback
        self.reports: dict[Any, dict[str, Any]] = {}
        # id(LayerInfo) -> key of its report (names can be empty; the infos live as long as
        # the capture does)
        self.keys: dict[int, Any] = {}

    def report(self, info: LayerInfo, selector: Any = None, impl: Any = None
               ) -> dict[str, Any]:
        """The report for ``info``'s shape (cached); an error is counted under
        ``kernel_map`` and kept as ``{"error": ...}``. Never raises."""
        fa_ran = getattr(impl, "vllm_flash_attn_version", None)
        key = self.keys.get(id(info))
        if key is None:
            key = (report_key(info), selector, info.backend, fa_ran)
            self.keys[id(info)] = key
        rep = self.reports.get(key)
        if rep is None:
            try:
                from attnprof.capture.vllm import backends

                rep = backends.vllm_backend_report(
                    info.num_heads, info.num_kv_heads, info.head_size, info.dtype,
                    info.kv_cache_dtype, info.sliding_window, has_sink=info.has_sink,
                    selected=info.backend, selector_config=selector,
                    flash_attn_version=fa_ran if isinstance(fa_ran, int) else None,
                    requires_alibi=getattr(impl, "alibi_slopes", None) is not None,
                    requires_softcap=bool(getattr(impl, "logits_soft_cap", None)),
                    fallback=self.fallback)
            except Exception as exc:
                self.errors.record("kernel_map", exc)
                rep = {"error": f"{type(exc).__name__}: {exc}"}
            self.reports[key] = rep
        return rep

    def kernel_map(self, layers: list[LayerInfo]) -> list[KernelGroup]:
        """Per group of identical layers: the backend that ran, the kernel variant, and why
        each other vLLM backend is not valid, asked of vLLM itself on this device (see
        :mod:`attnprof.capture.vllm.backends`). Computed once per layer shape."""
        for info in sorted(layers, key=lambda i: i.index):
            self.report(info)  # cached since model build (lazily without vLLM)
        return kernel_groups(layers, lambda i: self.keys[id(i)], self.reports)


def learn_model(cap: Any) -> None:
    """Workers never see the stat logger: read the served name from vLLM's config, and
    this worker's parallel placement, into ``cap`` (a :class:`~.hooks.Capture`). Without
    ``ATTNPROF_SEED`` the sampler is seeded from the server's instance id, shared by all its
    ranks, so they sample the same steps."""
    st = cap.state
    try:
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
    except Exception:
        return  # no vLLM config in force (not a vLLM model build): nothing to learn
    try:
        if not (st.config is not None and st.config.model_label):
            from attnprof.facts.label import model_label

            st.model_label = model_label(vc.model_config)
        if not cap.seed_shared and getattr(vc, "instance_id", None):
            digest = hashlib.blake2b(str(vc.instance_id).encode(), digest_size=8).digest()
            cap.sampler.reseed(int.from_bytes(digest, "little"))
            cap.seed_shared = True
        pc = vc.parallel_config
        cap.rank["tp_size"] = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        cap.rank["pp_size"] = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        cap.rank["dp_rank"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
        mc = vc.model_config
        cap.total_kv_heads = int(mc.get_total_num_kv_heads())
        cap.total_layers = int(getattr(mc.hf_text_config, "num_hidden_layers", 0)) or None
    except Exception as exc:
        cap.errors.record("model_label", exc)
    try:
        from vllm.distributed import parallel_state as ps

        cap.rank["tp_rank"] = int(ps.get_tensor_model_parallel_rank())
        cap.rank["pp_rank"] = int(ps.get_pp_group().rank_in_group)
    except Exception:
        pass  # no distributed state (unit tests, a single process): rank 0
    try:
        sync_ranks(cap, getattr(vc, "instance_id", None), getattr(vc, "parallel_config", None))
    except Exception as exc:
        cap.errors.record("install", exc)


def learn_kv_groups(cap: Any, kv_cache_config: Any) -> None:
    """Each wrapped layer's vLLM KV-cache group (index, spec, window, block size, bytes per
    token), from the runner's ``kv_cache_config`` as vLLM allocates the KV cache: the
    kernel map keys on the group. A layer vLLM does not list keeps ``kv_group`` None."""
    from attnprof.capture.vllm.args import kv_cache_groups

    facts = kv_cache_groups(kv_cache_config)
    for info in list(cap.aggs.layers.values()):
        f = facts.get(info.name)
        if f is None:
            continue
        info.kv_group, info.kv_spec = f.group, f.spec
        info.kv_block_size, info.kv_bytes_per_token = f.block_size, f.bytes_per_token


def sync_ranks(cap: Any, instance: Any, parallel_config: Any = None) -> None:
    """Tensor-parallel ranks agree on the budget's scale through the first rank's
    announcements (:mod:`attnprof.capture.vllm.rank_sync`): a node-local file, or the API
    server's poll when the ranks may span nodes (``ATTNPROF_RANK_SYNC``: ``auto`` decides
    from vLLM's parallel config, the same way on every rank); alone, a rank applies its own."""
    if cap.rank["tp_size"] <= 1 or cap.sampler.sync is not None:
        return
    from attnprof.capture.vllm.rank_sync import (
        RateChannel,
        RpcRate,
        channel_path,
        group_key,
        sync_mode,
    )

    cfg = cap.state.config
    mode = sync_mode(cfg.rank_sync if cfg is not None else "auto", parallel_config)
    leader = cap.rank["tp_rank"] == 0
    if mode == "rpc":
        cap.sampler.sync = RpcRate(group_key(cap.rank["dp_rank"], cap.rank["pp_rank"]), leader)
    else:
        # Without an instance id, the ranks' common parent (the engine) and shared seed.
        key = str(instance) if instance else f"{os.getppid()}:{cap.sampler.seed}"
        cap.sampler.sync = RateChannel(
            channel_path(key, cap.rank["dp_rank"], cap.rank["pp_rank"],
                         cfg.run_dir if cfg is not None else None),
            leader, cap.sampler.epoch)
    cap.sampler.sync_role = "leader" if leader else "follower"
