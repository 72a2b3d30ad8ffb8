"""A deterministic ~1M-parameter Llama-config causal LM with a digit-level tokenizer.

Built by code so tests and the demo need no download. The model is a `LlamaConfig` (a
Qwen2 config makes transformers 5 swap the tokenizer class and drop tokens), head size 32
so vLLM's CPU attention can serve it too.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
WORDS = ["copy", "reverse", "sort", "add", "+", "=", ":"]
DIGITS = [str(d) for d in range(10)]
VOCAB = SPECIAL_TOKENS + DIGITS + WORDS

# Messages are concatenated and followed by " =": the model answers after the '='. An
# assistant turn renders as "= <answer><eos>", so a conversation with its answers (SFT,
# preference pairs: src/ratchet/data/conversations.py) extends the prompt's rendering token
# by token; a prompt alone renders as before ("... =", with or without a generation prompt).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}= {{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt or messages[-1]['role'] != 'assistant' %}={% endif %}"
)


def build_tokenizer():
    """A word-level tokenizer over digits, task words and specials; digits split singly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    # Decoded responses read "3914", not "3 9 1 4": the reward compares digit strings.
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, *, hidden: int = 128, layers: int = 4, heads: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=VOCAB.index("<bos>"),
        eos_token_id=VOCAB.index("<eos>"),
        pad_token_id=VOCAB.index("<pad>"),
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, hidden: int = 128, layers: int = 4, heads: int = 4) -> Path:
    """Write tokenizer and randomly initialised model (safetensors) to `out_dir`; same seed, same bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), hidden=hidden, layers=layers, heads=heads))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_reward_model(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2) -> Path:
    """A tiny `LlamaForSequenceClassification` with one label over the same digit tokenizer:
    a reward model for tests and examples (random weights unless you train it)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden=hidden, layers=layers, heads=heads)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
