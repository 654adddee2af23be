"""Model presets: the `config.json` fields that decide memory, each citing its source.

Keys are Hugging Face config names, so `--override` and `--config` speak the same
language as the presets. Only fields that change memory or the parameter count are
kept; everything else in the original file is irrelevant here.
"""

from __future__ import annotations

from typing import Any

# Shared shapes. Each preset below cites the config.json its numbers come from.
_LLAMA1 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-6,
               rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float16")
_LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float16")
_CODELLAMA = dict(model_type="llama", vocab_size=32016, max_position_embeddings=16384, rms_norm_eps=1e-5,
                  rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072)

_QWEN25 = dict(model_type="qwen2", vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0,
               tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072, torch_dtype="bfloat16")
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False, head_dim=128, attention_bias=False,
              use_sliding_window=False, sliding_window=None, torch_dtype="bfloat16")
_MIXTRAL = dict(model_type="mixtral", rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                sliding_window=None, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                torch_dtype="bfloat16")
_LLAMA4 = dict(model_type="llama4_text", vocab_size=202048, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=False, head_dim=128, intermediate_size_mlp=16384, num_experts_per_tok=1,
               attention_chunk_size=8192, attention_bias=False, torch_dtype="bfloat16",
               hidden_size=5120, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=40,
               num_key_value_heads=8)


def _dims(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra: Any) -> dict:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)


# name -> (Hugging Face id, source of the numbers, config fields)
PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # LLaMA 1: https://huggingface.co/huggyllama/llama-7b/blob/main/config.json (and -13b, -30b, -65b)
    "llama-7b": ("huggyllama/llama-7b", "huggyllama/llama-7b config.json",
                 dict(_LLAMA1, **_dims(4096, 11008, 32, 32, 32))),
    "llama-13b": ("huggyllama/llama-13b", "huggyllama/llama-13b config.json",
                  dict(_LLAMA1, **_dims(5120, 13824, 40, 40, 40))),
    "llama-33b": ("huggyllama/llama-30b", "huggyllama/llama-30b config.json (the '33B' model)",
                  dict(_LLAMA1, **_dims(6656, 17920, 60, 52, 52))),
    "llama-65b": ("huggyllama/llama-65b", "huggyllama/llama-65b config.json",
                  dict(_LLAMA1, **_dims(8192, 22016, 80, 64, 64))),
    # Llama 2: https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (and -13b, -70b)
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf config.json",
                   dict(_LLAMA2, **_dims(4096, 11008, 32, 32, 32))),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-hf config.json",
                    dict(_LLAMA2, **_dims(5120, 13824, 40, 40, 40))),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf config.json",
                    dict(_LLAMA2, **_dims(8192, 28672, 80, 64, 8))),
    # Code Llama: https://huggingface.co/codellama/CodeLlama-7b-hf/blob/main/config.json (and -13b, -34b, -70b)
    "codellama-7b": ("codellama/CodeLlama-7b-hf", "codellama/CodeLlama-7b-hf config.json",
                     dict(_CODELLAMA, **_dims(4096, 11008, 32, 32, 32))),
    "codellama-13b": ("codellama/CodeLlama-13b-hf", "codellama/CodeLlama-13b-hf config.json",
                      dict(_CODELLAMA, **_dims(5120, 13824, 40, 40, 40))),
    # The 34B model dropped the 16 infilling tokens: vocab 32000.
    "codellama-34b": ("codellama/CodeLlama-34b-hf", "codellama/CodeLlama-34b-hf config.json",
                      dict(_CODELLAMA, vocab_size=32000, **_dims(8192, 22016, 48, 64, 8))),
    "codellama-70b": ("codellama/CodeLlama-70b-hf", "codellama/CodeLlama-70b-hf config.json",
                      dict(_CODELLAMA, **_dims(8192, 28672, 80, 64, 8))),
    # Llama 3: https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json (and -70B)
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B config.json",
                   dict(_LLAMA3, **_dims(4096, 14336, 32, 32, 8))),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B config.json",
                    dict(_LLAMA3, **_dims(8192, 28672, 80, 64, 8))),
    # Llama 3.1: https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (and -70B, -405B)
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B config.json",
                     dict(_LLAMA31, **_dims(4096, 14336, 32, 32, 8))),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B config.json",
                      dict(_LLAMA31, **_dims(8192, 28672, 80, 64, 8))),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B config.json",
                       dict(_LLAMA31, **_dims(16384, 53248, 126, 128, 8))),
    # Llama 3.2: https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json (and -3B); tied embeddings
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B config.json",
                     dict(_LLAMA31, tie_word_embeddings=True, head_dim=64, **_dims(2048, 8192, 16, 32, 8))),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B config.json",
                     dict(_LLAMA31, tie_word_embeddings=True, head_dim=128, **_dims(3072, 8192, 28, 24, 8))),
    # Llama 3.3: https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct config.json",
                      dict(_LLAMA31, **_dims(8192, 28672, 80, 64, 8))),
    # https://huggingface.co/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T/blob/main/config.json
    "tinyllama-1.1b": ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
                       "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json",
                       dict(_LLAMA2, max_position_embeddings=2048, torch_dtype="float32",
                            **_dims(2048, 5632, 22, 32, 4))),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: sliding window 4096
    "mistral-7b-v0.1": ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1 config.json",
                        dict(model_type="mistral", vocab_size=32000, max_position_embeddings=32768,
                             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                             sliding_window=4096, torch_dtype="bfloat16", **_dims(4096, 14336, 32, 32, 8))),
    # https://huggingface.co/deepseek-ai/DeepSeek-R1-Distill-Llama-8B/blob/main/config.json (and -70B): Llama 3.1 8B
    # and Llama 3.3 70B shapes, fine-tuned on DeepSeek-R1 outputs
    "deepseek-r1-distill-llama-8b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
                                     "deepseek-ai/DeepSeek-R1-Distill-Llama-8B config.json",
                                     dict(_LLAMA31, **_dims(4096, 14336, 32, 32, 8))),
    "deepseek-r1-distill-llama-70b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
                                      "deepseek-ai/DeepSeek-R1-Distill-Llama-70B config.json",
                                      dict(_LLAMA31, **_dims(8192, 28672, 80, 64, 8))),
    # https://huggingface.co/mistralai/Mistral-Nemo-Base-2407/blob/main/config.json: head_dim 128 (not 5120 / 32),
    # no sliding window, the 131,072-token Tekken vocabulary
    "mistral-nemo-12b": ("mistralai/Mistral-Nemo-Base-2407", "mistralai/Mistral-Nemo-Base-2407 config.json",
                         dict(model_type="mistral", vocab_size=131072, max_position_embeddings=1024000,
                              rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None,
                              head_dim=128, torch_dtype="bfloat16", **_dims(5120, 14336, 40, 32, 8))),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (and -72B): q/k/v biases; the sliding window
    # in the file is off (use_sliding_window false)
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B config.json",
                   dict(_QWEN25, rms_norm_eps=1e-6, max_window_layers=28, **_dims(3584, 18944, 28, 28, 4))),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B config.json",
                    dict(_QWEN25, rms_norm_eps=1e-5, max_window_layers=80, **_dims(8192, 29568, 80, 64, 8))),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (and -32B): q/k RMSNorms, head_dim 128 set apart
    "qwen3-8b": ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B config.json", dict(_QWEN3, **_dims(4096, 12288, 36, 32, 8))),
    "qwen3-32b": ("Qwen/Qwen3-32B", "Qwen/Qwen3-32B config.json", dict(_QWEN3, **_dims(5120, 25600, 64, 64, 8))),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 128 experts of width 768, 8 per token, every
    # layer sparse (decoder_sparse_step 1, no mlp_only_layers)
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B config.json",
                      dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                           moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                           **_dims(2048, 6144, 48, 32, 4))),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: 8 experts, 2 per token
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-v0.1 config.json",
                     dict(_MIXTRAL, vocab_size=32000, max_position_embeddings=32768, router_aux_loss_coef=0.02,
                          **_dims(4096, 14336, 32, 32, 8))),
    # https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json: the v3 tokenizer's 32,768 tokens
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-v0.1", "mistralai/Mixtral-8x22B-v0.1 config.json",
                      dict(_MIXTRAL, vocab_size=32768, max_position_embeddings=65536, router_aux_loss_coef=0.001,
                           **_dims(6144, 16384, 56, 48, 8))),
    # https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json, its text_config (the language
    # model; the vision encoder is not counted): 16 routed experts + a shared one in every layer, top-1
    "llama-4-scout-17b-16e": ("meta-llama/Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Scout-17B-16E config.json "
                              "text_config",
                              dict(_LLAMA4, num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
                                   max_position_embeddings=10485760)),
    # https://huggingface.co/meta-llama/Llama-4-Maverick-17B-128E/blob/main/config.json, its text_config: 128 routed
    # experts in every second layer (dense 16384-wide MLPs between), no q/k norm
    "llama-4-maverick-17b-128e": ("meta-llama/Llama-4-Maverick-17B-128E",
                                  "meta-llama/Llama-4-Maverick-17B-128E config.json text_config",
                                  dict(_LLAMA4, num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False,
                                       max_position_embeddings=1048576)),
    # A tiny model for tests and quick traces: GQA (4 heads, 2 KV heads), untied head.
    "debug": ("llamem/debug", "llamem built-in test model",
              dict(model_type="llama", vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
                   **_dims(256, 688, 4, 4, 2))),
}

# Spellings the normalising rule in model.py cannot derive. That rule already accepts any case, the
# organisation prefix or none ('Llama-3.1-8B'), '-hf', 'Meta-Llama-3' for 'llama-3', 'llama2' for
# 'llama-2', and '-Instruct' / '-chat' for the presets in SAME_SHAPE_FINETUNES.
ALIASES: dict[str, str] = {
    "mistral-7b": "mistral-7b-v0.1",  # the first 7B release; v0.2 and v0.3 have other configs
    "tinyllama": "tinyllama-1.1b",
    # https://huggingface.co/TinyLlama/TinyLlama-1.1B-Chat-v1.0/blob/main/config.json: the same shapes as
    # the 1431k-3T base (2048 / 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000)
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "tinyllama-1.1b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral-8x22b-v0.1": "mixtral-8x22b",
    "llama-4-scout": "llama-4-scout-17b-16e",
    "llama-4-maverick": "llama-4-maverick-17b-128e",
    "mistral-nemo": "mistral-nemo-12b",
    "mistral-nemo-2407": "mistral-nemo-12b",
    # https://huggingface.co/mistralai/Mistral-Nemo-Instruct-2407/blob/main/config.json: the base model's shapes
    "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-12b",
}

# Presets whose chat / instruct fine-tunes have the same config.json shapes (only the weights differ),
# so 'meta-llama/Llama-2-7b-chat-hf' or 'llama-3.1-8b-instruct' resolve to them. Each cites the
# fine-tune's config.json it relies on. Not listed, so not resolved: Code Llama's -Instruct models (their
# configs were not compared) and Mistral-7B-Instruct v0.2 / v0.3, which are other models to llamem (no
# sliding window; v0.3 a larger vocabulary): their normalised names are not presets.
SAME_SHAPE_FINETUNES: dict[str, str] = {
    "llama-2-7b": "https://huggingface.co/meta-llama/Llama-2-7b-chat-hf/blob/main/config.json",
    "llama-2-13b": "https://huggingface.co/meta-llama/Llama-2-13b-chat-hf/blob/main/config.json",
    "llama-2-70b": "https://huggingface.co/meta-llama/Llama-2-70b-chat-hf/blob/main/config.json",
    "llama-3-8b": "https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct/blob/main/config.json",
    "llama-3-70b": "https://huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct/blob/main/config.json",
    "llama-3.1-8b": "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json",
    "llama-3.1-70b": "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json",
    "llama-3.1-405b": "https://huggingface.co/meta-llama/Llama-3.1-405B-Instruct/blob/main/config.json",
    "llama-3.2-1b": "https://huggingface.co/meta-llama/Llama-3.2-1B-Instruct/blob/main/config.json",
    "llama-3.2-3b": "https://huggingface.co/meta-llama/Llama-3.2-3B-Instruct/blob/main/config.json",
    # The preset is the instruct model itself (there is no base 3.3 release), so 'Llama-3.3-70B' resolves too.
    "llama-3.3-70b": "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json",
    "mistral-7b-v0.1": "https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.1/blob/main/config.json",
    "mixtral-8x7b": "https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json",
    "mixtral-8x22b": "https://huggingface.co/mistralai/Mixtral-8x22B-Instruct-v0.1/blob/main/config.json",
    "qwen2.5-7b": "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json",
    "qwen2.5-72b": "https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json",
    "llama-4-scout-17b-16e": "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json",
    "llama-4-maverick-17b-128e":
        "https://huggingface.co/meta-llama/Llama-4-Maverick-17B-128E-Instruct/blob/main/config.json",
}
