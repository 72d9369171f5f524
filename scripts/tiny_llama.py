"""Build a tiny random-weight Llama checkpoint that real vLLM can serve on a CPU in seconds.

CI cannot download models, so the vLLM tests get one made here: a byte-level BPE tokenizer
trained on a few sentences and a 2-layer LlamaForCausalLM with seeded random weights, saved as
safetensors. Run with the vLLM venv's python (it has torch, transformers and tokenizers).

Usage: python scripts/tiny_llama.py DIR   (prints DIR's absolute path as its last line)
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Set before transformers is imported: nothing here may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keeps the output to our own lines

# Bump when the recipe changes, so existing caches are rebuilt rather than reused.
RECIPE = "tiny-llama-v1"
MARKER = ".omni-dp-tiny-llama"
SEED = 1234
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# Plain-text turns; the model is random, so the template only has to be valid and stable.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SENTENCES = [
    "Hello, world! This is a tiny model for tests.",
    "The quick brown fox jumps over the lazy dog.",
    "A replica serves requests behind a router.",
    "The router sends each request to the least loaded replica.",
    "Every replica owns a slice of the KV cache.",
    "Tokens are generated one at a time until the stop condition.",
    "Once upon a time there was a small language model.",
    "It could only say random things, but it said them quickly.",
    "What is the capital of France? Paris is the capital of France.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 65536.",
    "The metrics endpoint reports the cache configuration.",
    "Health checks return 200 when the server is ready.",
    "Streaming responses arrive as server-sent events.",
    "The user asked a question and the assistant answered it.",
    "system: You are a helpful assistant.",
    "user: Tell me a story about a robot.",
    "assistant: Once there was a robot who loved to count blocks.",
    "Data parallel serving runs many copies of the same model.",
    "Each copy has its own process, port and memory budget.",
    "Shut down cleanly when the launcher sends SIGTERM.",
    "JSON, HTTP, TCP and UDP are common protocols.",
    "def main():\n    print('hello')\n    return 0\n",
    "for i in range(10):\n    total += i\n",
    "Rain falls on the hills; rivers run to the sea.",
    "Bright stars shine over quiet towns at night.",
    "She reads books, he writes letters, they play music.",
    "Coffee, tea, water, juice and milk are drinks.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday.",
    "January February March April May June July August.",
    "Red, orange, yellow, green, blue, indigo and violet.",
    "Please answer briefly and clearly.",
    "Thank you! You're welcome. Good morning and good night.",
    "The end.",
]


def build_tokenizer():
    """Train a byte-level BPE locally: any input text encodes, with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_model(tokenizer):
    """float32, and vLLM must be started with `--dtype float32`: its "auto" serves float32
    checkpoints as bfloat16 on x86, and vLLM 0.32's eager CPU attention for bfloat16 takes an
    AMX path that dies with SIGILL on this kind of VM; float32 runs on any x86 host."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config.dtype = torch.float32
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def is_complete(path: Path) -> bool:
    """The marker is written last, so its recipe line means the whole checkpoint is there."""
    marker = path / MARKER
    return marker.is_file() and marker.read_text().strip() == RECIPE


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    target = Path(argv[1]).resolve()
    if is_complete(target):
        print(f"make-tiny-llama: {target} is already complete")
        print(target)
        return 0
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so an interrupted run never leaves a half model there.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; the model is no secret
        (tmp / MARKER).write_text(RECIPE + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(p.numel() for p in model.parameters())
    print(
        f"make-tiny-llama: wrote {params:,} parameters, vocab {len(tokenizer)}"
        f" in {time.monotonic() - start:.1f}s"
    )
    print(target, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
