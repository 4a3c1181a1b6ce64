"""FlashInfer's attention metadata read as FLASH_ATTN's is (capture/vllm/args.py): vLLM 0.32's
``FlashInferMetadata`` has no ``seq_lens`` or ``block_table``; the decodes' and prefills' lengths
and block-table slices live in its parts. vLLM's FlashInfer module imports the ``flashinfer``
package (GPU only, absent here), so the metadata classes are rebuilt from their definitions in
the installed vLLM's source (the same field names, checked), and filled as
``FlashInferMetadataBuilder.build`` fills them from a batch. The oracle: the same batch as
FLASH_ATTN-style metadata (``seq_lens``, ``query_start_loc``, ``block_table``), read by the
reader the real-engine tests cover."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.layers import LayerInfo
from attnprof.capture.vllm import args as vargs
from attnprof.capture.vllm.hooks import Capture
from attnprof.config import Config
from attnprof.host.vllm.runtime import State


def _source() -> Path:
    spec = importlib.util.find_spec("vllm")  # the package's location, nothing imported
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    return Path(spec.origin).parent / "v1" / "attention" / "backends" / "flashinfer.py"


def _classes() -> dict[str, Any]:
    """vLLM's FlashInfer metadata dataclasses, their fields as its source declares them."""
    tree = ast.parse(_source().read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in (
                "FlashInferMetadata", "TRTLLMPrefill", "FlashInferTrtllmAPIDecode", "FIPrefill",
                "FIDecode"):
            fields = [(s.target.id, Any, dataclasses.field(default=None))
                      for s in node.body if isinstance(s, ast.AnnAssign)
                      and isinstance(s.target, ast.Name)]
            out[node.name] = dataclasses.make_dataclass(node.name, fields)
    return out


C = _classes()


def test_vllms_classes_have_the_fields_read() -> None:
    def names(c: str) -> set[str]:
        return {f.name for f in dataclasses.fields(C[c])}
    assert {"num_actual_tokens", "num_decodes", "num_decode_tokens", "num_prefills",
            "num_prefill_tokens", "prefill", "decode"} <= names("FlashInferMetadata")
    assert "seq_lens" not in names("FlashInferMetadata")  # why a reader of its own
    assert "block_table" not in names("FlashInferMetadata")
    assert {"block_tables", "seq_lens", "cum_seq_lens_q"} <= names("TRTLLMPrefill")
    assert {"block_tables", "seq_lens", "q_cu_seq_lens"} <= names("FlashInferTrtllmAPIDecode")
    assert names("FIPrefill") == names("FIDecode") == {"wrapper"}
    # build(): decodes first, each part a slice of the batch's tensors
    src = _source().read_text()
    for line in ("block_tables=block_table_tensor[:num_decodes]",
                 "prefill_block_tables = block_table_tensor[prefill_start:]",
                 "prefill_seq_lens = seq_lens[prefill_start:]",
                 "seq_lens_decode = seq_lens[:num_decodes]",
                 "qo_indptr[prefill_start:] - qo_indptr[prefill_start]",
                 "prefill_start = num_decodes"):
        assert line in src, line


def _batch(q: list[int], s: list[int]) -> Any:
    """FLASH_ATTN-style metadata of a batch (decodes first, as vLLM orders it for both)."""
    starts = [0]
    for x in q:
        starts.append(starts[-1] + x)
    table = torch.arange(len(q) * 6, dtype=torch.int32).view(len(q), 6)
    return SimpleNamespace(num_actual_tokens=sum(q), max_query_len=max(q),
                           seq_lens=torch.tensor(s, dtype=torch.int32),
                           query_start_loc=torch.tensor(starts, dtype=torch.int32),
                           block_table=table)


def _flashinfer(fa: Any, nd: int, native: bool = False, ragged: bool = False) -> Any:
    """The same batch as ``FlashInferMetadataBuilder.build`` fills ``FlashInferMetadata``
    (TRTLLM parts; ``native``: FlashInfer's own wrappers, lengths inside them)."""
    q = (fa.query_start_loc[1:] - fa.query_start_loc[:-1]).tolist()
    n = len(q)
    nt_dec = sum(q[:nd])
    md = C["FlashInferMetadata"](num_actual_tokens=fa.num_actual_tokens, num_decodes=nd,
                                 num_decode_tokens=nt_dec, num_prefills=n - nd,
                                 num_prefill_tokens=fa.num_actual_tokens - nt_dec, causal=True)
    if nd:
        md.decode = C["FIDecode"](wrapper=object()) if native else C[
            "FlashInferTrtllmAPIDecode"](
            block_tables=fa.block_table[:nd], seq_lens=fa.seq_lens[:nd],
            max_seq_len=int(fa.seq_lens.max()), q_len_per_req=nt_dec // nd,
            q_cu_seq_lens=fa.query_start_loc[:nd + 1] if ragged else None)
    if n - nd:
        qo = fa.query_start_loc[nd:] - fa.query_start_loc[nd]
        md.prefill = C["FIPrefill"](wrapper=object()) if native else C["TRTLLMPrefill"](
            block_tables=fa.block_table[nd:], seq_lens=fa.seq_lens[nd:], cum_seq_lens_q=qo,
            cum_seq_lens_kv=None, max_q_len=int(max(q[nd:])), max_seq_len=0)
    return md


CASES = {
    "pure decode": ([1, 1, 1], [40, 7, 300], 3, False),
    "pure prefill (whole prompts)": ([12, 30], [12, 30], 0, False),
    "mixed": ([1, 1, 16], [90, 33, 16], 2, False),
    "chunked (a later chunk of a long prompt)": ([1, 64], [20, 192], 1, False),
    "speculative decode (ragged queries)": ([3, 1, 2], [50, 21, 9], 3, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trtllm_parts_read_as_flash_attn(case: str) -> None:
    q, s, nd, ragged = CASES[case]
    fa = _batch(q, s)
    md = _flashinfer(fa, nd, ragged=ragged)
    want = vargs.batch_shape(fa)
    got = vargs.batch_shape(md)
    assert got == want and got.q_lens == tuple(q) and got.seq_lens == tuple(s)
    assert vargs.batch_shape(vargs.shape_inputs(md)) == want  # the GPU path's capture
    assert torch.equal(vargs.block_table(md), fa.block_table)


def test_native_parts_keep_counts_and_say_lengths_are_unread() -> None:
    fa = _batch([1, 1, 16], [90, 33, 16])
    md = _flashinfer(fa, 2, native=True)
    shape = vargs.batch_shape(md)
    assert (shape.phase, shape.num_tokens, shape.num_reqs) == ("mixed", 18, 3)
    assert shape.seq_lens == () and shape.pairs == 0 and vargs.block_table(md) is None
    assert vargs.batch_shape(vargs.shape_inputs(md)) == shape
    assert vargs.batch_shape(_flashinfer(_batch([1], [5]), 1, native=True)).phase == "decode"
    # a sampled step of it: timed, counted as a drop, not an error
    state = State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m"))
    cap = Capture(state)
    info = LayerInfo(name="model.layers.0.self_attn.attn", index=0, backend="FLASHINFER",
                     impl="FlashInferImpl", num_heads=4, num_kv_heads=2, head_size=64,
                     head_size_v=64, sliding_window=None, dtype="bfloat16",
                     kv_cache_dtype="auto", fused=True, scale=0.125)
    cap.aggs.add_layer(info)
    cap._finish_step(0.01, "sampled", [(info, md, 0.0, 0.002), (info, md, 0.002, 0.004)],
                     False)
    assert cap.errors.dropped == {vargs.LENGTHS_UNREAD: 1} and cap.errors.by_place == {}
    assert cap.aggs.outcomes.get("sampled") == 1


def _v1_runner(fa: Any, extra: int = 2) -> Any:
    """A V1 runner's step buffers as ``_prepare_inputs`` fills them for this batch (longer than
    the batch: the rest is padding or an earlier step's)."""
    n = len(fa.seq_lens)
    qsl = np.concatenate([fa.query_start_loc.numpy(), np.full(extra, 999)]).astype(np.int32)
    seq = torch.cat([fa.seq_lens, torch.zeros(extra, dtype=torch.int32)])
    assert len(seq) == n + extra
    return SimpleNamespace(query_start_loc=SimpleNamespace(np=qsl), optimistic_seq_lens_cpu=seq)


@pytest.mark.parametrize("case", list(CASES))
def test_native_parts_read_the_runners_step(case: str) -> None:
    """Native FlashInfer plans from the common metadata's CPU query starts and sequence
    lengths: attnprof reads the same from the runner (V1's buffers, V2's InputBatch)."""
    q, s, nd, _ = CASES[case]
    fa = _batch(q, s)
    md = _flashinfer(fa, nd, native=True)
    want = vargs.batch_shape(fa)
    v1 = (_v1_runner(fa), None)
    assert vargs.batch_shape(md, v1) == want
    assert vargs.batch_shape(vargs.shape_inputs(md, v1)) == want
    batch = SimpleNamespace(query_start_loc_np=fa.query_start_loc.numpy().astype(np.int32),
                            seq_lens_cpu_upper_bound=fa.seq_lens.clone())
    assert vargs.batch_shape(md, (object(), batch)) == want  # V2: the step's InputBatch


def test_runner_buffers_of_another_batch_are_not_read() -> None:
    fa = _batch([1, 1, 16], [90, 33, 16])
    md = _flashinfer(fa, 2, native=True)
    other = _v1_runner(_batch([1, 1, 15], [90, 33, 15]))  # its last start is not md's tokens
    assert vargs.batch_shape(md, (other, None)).seq_lens == ()
    assert vargs.batch_shape(md, (SimpleNamespace(), None)).seq_lens == ()  # nothing to read
    assert vargs.batch_shape(md, (None, None)).seq_lens == ()


def test_the_runner_fields_read_are_where_vllm_builds_metadata_from() -> None:
    root = _source().parents[3]
    v1 = (root / "v1" / "worker" / "gpu_model_runner.py").read_text()
    assert "query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs_padded + 1]" in v1
    assert "seq_lens_cpu_upper_bound = self.optimistic_seq_lens_cpu[:num_reqs_padded]" in v1
    v2 = (root / "v1" / "worker" / "gpu" / "model_states" / "default.py").read_text()
    assert "input_batch.query_start_loc_np[: num_reqs + 1]" in v2
    assert "seq_lens_cpu_upper_bound = input_batch.seq_lens_cpu_upper_bound" in v2
    fi = _source().read_text()  # FlashInfer's native plan reads the same upper bound
    assert "seq_lens_cpu = common_attn_metadata.seq_lens_cpu_upper_bound" in fi
