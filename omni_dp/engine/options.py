"""`omni-dp serve` options: each default once, with what its flag's help says (the command's
click options are generated from these fields). Torch-free, so that `--help` never loads it;
engine/plan.py turns the options into a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The talker's dtypes besides auto, by torch's names (engine/plan.py maps them to torch's).
DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
DEFAULT_PAGE_SIZE = 16  # tokens per KV page
# Used when neither --kv-cache-bytes nor --max-total-tokens is given (rounded down to whole
# pages): room for 16 requests of the longest generation (1024 tokens), 128 MiB for `tiny`.
DEFAULT_MAX_TOTAL_TOKENS = 16384
SHARE_ROLES = ("leader", "follower")  # --share-weights (engine/share/)
# `--model auto` (the default): the bundled voice where it can run here, else the seeded preset
# `tiny` (with a line saying its audio is noise). This variable names auto's choice instead:
# the tests and benchmarks of the seeded presets set it to `tiny` (tests/conftest.py).
DEFAULT_MODEL_ENV = "OMNI_DP_DEFAULT_MODEL"
AUTO_MODEL = "auto"
# OpenAI's bound on a speech request's `input`, in characters: the default of --max-input-chars.
OPENAI_MAX_INPUT_CHARS = 4096
# A voice's sentences being spoken ahead of the one streaming, per request (--voice-lookahead):
# 2 keeps two voice workers or processes busy on one request, and bounds what a request has in
# flight (and how far it can get ahead of the others) to 2 sentences.
DEFAULT_VOICE_LOOKAHEAD = 2
# The longest first piece of a voice's answer (--voice-first-piece-chars): about 15 words, 0.2 s
# of joe's graph on one CPU thread and 4-5 s of speech, which covers speaking the next pieces.
DEFAULT_VOICE_FIRST_PIECE_CHARS = 80
# --priority-share-every's default (engine/priority.py, torch-free like this module).
DEFAULT_PRIORITY_SHARE_EVERY = 4

# `serve --help` lists the flags under these titles, in this order (each field names its own
# "section"; omni_dp/cli/common.py's SectionedCommand draws them), as vLLM's help groups its.
SERVER = "Server (address, requests, shutdown)"
MODEL = "Model and device"
KV = "KV cache, batching and the queue"
VOICE = "Piper voice streaming"
PLACEMENT = "Placement and shared weights"
OBSERVABILITY = "Observability (traces, logs)"
SERVE_SECTIONS = (SERVER, MODEL, KV, VOICE, PLACEMENT, OBSERVABILITY)


@dataclass(frozen=True)
class ServeOptions:
    host: str = field(default="127.0.0.1", metadata={
        "section": SERVER, "help": "Address to listen on."})
    port: int = field(default=8100, metadata={
        "section": SERVER,
        "help": "TCP port to listen on (0 picks a free one and logs it)."})
    model: str = field(default=AUTO_MODEL, metadata={
        "section": MODEL, "metavar": "auto|joe|tiny|small|DIR",
        "help": "joe: a trained Piper voice (scripts/setup installs it); a Piper voice "
                "directory (NAME.onnx + NAME.onnx.json); a preset with seeded weights, whose "
                "audio is noise (tiny: ~3M params, for CPU and tests; small: ~80M, for GPU "
                "demos); or a directory written by `omni-dp save-weights`. auto: joe where it "
                f"is installed, else tiny, saying so (${DEFAULT_MODEL_ENV} names auto's "
                "choice instead)."})
    weight_seed: int = field(default=0, metadata={
        "section": MODEL,
        "help": "Seed of a preset's weights; replicas with equal seeds sound the same."})
    device: str = field(default="auto", metadata={
        "section": MODEL, "metavar": "auto|cpu|cuda[:N]",
        "help": "Where the talker and vocoder run; auto = cuda:0 when CUDA is available."})
    dtype: str = field(default="auto", metadata={
        "section": MODEL, "choices": ("auto", *DTYPE_NAMES),
        "help": "Talker weights and KV dtype. auto = float64 on CPU (output independent of "
                "batching) and bfloat16 on CUDA."})
    threads: int | None = field(default=None, metadata={
        "section": MODEL,
        "help": "Torch intra-op threads. [default: the CPUs this process may run on]"})
    kv_cache_bytes: int | None = field(default=None, metadata={
        "section": KV, "size": True,
        "help": "Size the KV pool by memory: floor(SIZE / (page × bytes per token)) pages."})
    max_total_tokens: int | None = field(default=None, metadata={
        "section": KV,
        "help": "Size the KV pool by capacity: exactly this many tokens (a whole number of "
                f"pages). [default: {DEFAULT_MAX_TOTAL_TOKENS} when neither knob is given]"})
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata={
        "section": KV, "help": "Tokens per KV page."})
    max_running_requests: int = field(default=32, metadata={
        "section": KV,
        "help": "Largest running batch; more requests wait in the queue."})
    max_queued_requests: int = field(default=256, metadata={
        "section": KV,
        "help": "Requests that may wait beyond the running batch; more get 503 + Retry-After."})
    priority_share_every: int = field(default=DEFAULT_PRIORITY_SHARE_EVERY, metadata={
        "section": KV,
        "help": "Priority classes (header X-Omni-DP-Priority: interactive, default, bulk): "
                "queued work runs highest class first, FIFO within a class, but a lower class "
                "that waits gets at least 1 dispatch in every K (K = this; at least 2)."})
    max_input_chars: int = field(default=OPENAI_MAX_INPUT_CHARS, metadata={
        "section": SERVER,
        "help": "Longest accepted input text, in characters after normalisation; longer is a "
                "400 naming `input` and the limit. The default is OpenAI's bound on `input`; "
                "raise it to speak longer texts (a voice streams them sentence by sentence; "
                "--max-body-bytes may need raising too)."})
    voice_lookahead: int = field(default=DEFAULT_VOICE_LOOKAHEAD, metadata={
        "section": VOICE,
        "help": "A Piper voice: sentences of a request already being spoken while the one "
                "before them streams (on the replica's voice workers or processes, in order; "
                "a hang-up or cut-off drops them). 0: one sentence at a time."})
    voice_first_piece_chars: int = field(default=DEFAULT_VOICE_FIRST_PIECE_CHARS, metadata={
        "section": VOICE,
        "help": "A Piper voice: a first sentence longer than this many characters is spoken "
                "in pieces of at most this many, cut at its commas, semicolons, colons and "
                "dashes, so that the first audio does not wait for the whole sentence. 0: "
                "spoken whole."})
    max_body_bytes: int = field(default=64 * 1024, metadata={
        "section": SERVER, "size": True, "help": "Largest accepted request body."})
    drain_timeout: float = field(default=30.0, metadata={
        "section": SERVER,
        "help": "Seconds in-flight requests may take to finish after SIGTERM."})
    served_model_name: str | None = field(default=None, metadata={
        "section": SERVER,
        "help": "Model id shown by /v1/models and in the metrics' model_name label; a "
                "request's `model` must be it, absent, or an OpenAI TTS name (tts-1, "
                "tts-1-hd, gpt-4o-mini-tts), else 404. [default: omni-dp-<preset>]"})
    share_weights: str | None = field(default=None, metadata={
        "section": PLACEMENT, "choices": SHARE_ROLES,
        "help": "Share the backbone weights with other replicas of this run on the same "
                "device: the leader publishes them in --share-dir, a follower maps them "
                "read-only instead of loading its own copy (and exits 4 when its leader is "
                "gone). [default: no sharing]"})
    placement_config: str | None = field(default=None, metadata={
        "section": PLACEMENT, "metavar": "FILE",
        "help": "A YAML file placing the stages on processes and devices (top-level keys: "
                "the stages, preprocess, talker, vocoder for the seeded presets, preprocess, "
                "voice for a voice; and placement), applied over the pipeline's defaults "
                "(every stage in one process); dotted options override it: --vocoder.process "
                "vocoder, --talker.gpu_memory_fraction 0.85, --talker.tp_size 2, "
                "--vocoder.replicas 2, --placement.max_total_gpu_memory_fraction_per_gpu 0.9, "
                "--placement.fused_stages talker,vocoder. --dry-run prints the process table."})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "section": OBSERVABILITY, "metavar": "URL",
        "help": "Export a span per request and per stage's work (a voice's sentence, a "
                "preprocess) to this OTLP/HTTP traces receiver, e.g. "
                "http://127.0.0.1:4318/v1/traces (vLLM's flag of that name); a request's W3C "
                "traceparent header is its span's parent. [default: no tracing]"})
    # The dotted --<stage>.<field> options, as (key, value) in command-line order; the CLI
    # collects them (click cannot declare an open set of options).
    placement_overrides: tuple[tuple[str, str], ...] = field(default=(), metadata={"flag": None})
    share_dir: str | None = field(default=None, metadata={
        "section": PLACEMENT, "metavar": "DIR",
        "help": "With --share-weights: the private (0700) directory the leader publishes in "
                "(created if missing) and followers read."})
