"""What each drop reason means: the ``reason`` label of ``attnprof_dropped_samples_total`` and
the keys of a worker snapshot's ``dropped``, each with the one line that says what was not seen
and why. The capture code passes these names to ``ErrorBook.drop``; a unit test holds every
name it drops to this catalog. Pure: no vLLM, no torch.
"""

from __future__ import annotations

DROP_REASONS: dict[str, str] = {
    "capture_error": "a layer call whose timing failed (the error counted by place): left out "
                     "of the step's timings",
    "gpu_events_pending": "a GPU step whose CUDA events had not completed when 64 newer steps "
                          "waited: the oldest dropped, never synchronised",
    "cudagraph_full_only": "a sampled step vLLM replayed as a full CUDA graph (no other mode "
                           "allowed): attention ran inside the graph, unseen (blind)",
    "flashinfer_lengths_unread": "a step whose metadata does not give per-request lengths "
                                 "(native FlashInfer): timed, its FLOPs and KV reads not "
                                 "counted",
    "head_stats_unreadable_cache": "head statistics of a chunk, cached tail or decode whose "
                                   "earlier keys sit in a KV cache attnprof cannot read "
                                   "(quantized, unverified layout): left out, not guessed",
    "head_stats_sliding_window": "head statistics of a chunk, cached tail or decode on a "
                                 "sliding-window layer past its window: vLLM freed the "
                                 "earlier keys",
    "head_stats_lengths_unread": "a sampled step's head statistics on a GPU whose lengths "
                                 "are not on the host: left out rather than wait for the "
                                 "device",
    "head_stats_worker_busy": "a sampled step that began while the statistics' worker held "
                              "half its bytes or 128 folds: its statistics left out whole",
    "head_stats_step_too_large": "a sampled step whose copies for every layer would not fit "
                                 "the statistics' worker's free bound (long contexts; "
                                 "ATTNPROF_HEAD_STATS_QUEUE_MB): left out whole, nothing "
                                 "copied",
    "head_stats_queue_full": "a layer call whose copies did not fit the statistics' worker "
                             "queue (4096 calls or ATTNPROF_HEAD_STATS_QUEUE_MB, 64 MiB by "
                             "default): dropped, never waited for",
}
"""Every drop reason, in the order a reader meets them (capture, graphs, statistics)."""
