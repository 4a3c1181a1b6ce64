"""Tiny random-weight models of every family the transformers integration supports, built
from a transformers config (nothing downloaded), and one forward's inputs for each."""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("gpt2", "bert", "llama", "vit", "bart", "t5")


def build(family: str, impl: str = "sdpa") -> Any:
    """A 2-layer (per stack) model of ``family`` in eval mode, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0,
            eos_token_id=0,
            attn_implementation=impl))
    elif family == "bert":
        m = tf.BertModel(tf.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=256, attn_implementation=impl))
    elif family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, attn_implementation=impl))
    elif family == "vit":
        m = tf.ViTModel(tf.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            image_size=32, patch_size=8, num_channels=3, attn_implementation=impl))
    elif family == "bart":
        m = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
            decoder_ffn_dim=128, max_position_embeddings=256, attn_implementation=impl))
    elif family == "gpt_neo":  # attention outside the registry: the module route
        m = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], window_size=8,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=0))
    elif family == "t5":
        m = tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
            num_heads=4, decoder_start_token_id=0, attn_implementation=impl))
    else:
        raise ValueError(family)
    return m.eval()


def inputs(family: str, seq_len: int = 12, batch: int = 1) -> dict[str, Any]:
    """Seeded inputs of one forward (vision: a 32x32 image, 16 patches + CLS)."""
    g = torch.Generator().manual_seed(seq_len)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    ids = torch.randint(1, 100, (batch, seq_len), generator=g)
    if family in ("bart", "t5"):
        return {"input_ids": ids, "decoder_input_ids": ids[:, : seq_len // 2]}
    return {"input_ids": ids}
